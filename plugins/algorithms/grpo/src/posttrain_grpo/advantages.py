"""Group-relative advantages: each sample's reward minus a baseline computed over the
other generations of the same prompt, optionally divided by the group's reward std and
clamped.

Groups are given as one integer id per sample (:func:`consecutive_group_ids` builds the ids
of the usual layout, ``num_generations_per_prompt`` consecutive samples per prompt). The
arithmetic runs in float64 per group, so a group whose rewards are all equal gets exactly
zero advantage and is never divided by its (zero) std.
"""

from __future__ import annotations

import torch

from posttrain_grpo.config import GRPOConfig

#: Added to the std before dividing (only where the std is > 0), as NeMo RL does.
STD_EPSILON = 1e-6


def consecutive_group_ids(num_samples: int, group_size: int) -> torch.Tensor:
    """Group ids ``[0]*group_size + [1]*group_size + ...`` (int64 [num_samples])."""
    if group_size < 1 or num_samples % group_size:
        raise ValueError(f"{num_samples} samples do not split into groups of {group_size}")
    return torch.arange(num_samples // group_size).repeat_interleave(group_size)


def baseline_and_std(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and reward std (float64 [B] each) within each sample's group.

    Mean baseline: the group mean and the group's unbiased std. Leave-one-out: the mean of
    the group's *other* samples and the unbiased std of those n-1 others (0 when there is
    only one other). A group of one sample, or whose rewards are all equal, gets baseline =
    reward and std 0; a std is also exactly 0 whenever the values it is taken over are equal.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    r = rewards.detach().to(torch.float64)
    baseline = torch.empty_like(r)
    std = torch.empty_like(r)
    for gid in torch.unique(group_ids):
        idx = (group_ids == gid).nonzero().squeeze(1)
        baseline[idx], std[idx] = (_leave_one_out if leave_one_out else _group_mean)(r[idx])
    return baseline, std


def _group_mean(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _all_equal(r):
        return r.clone(), torch.zeros_like(r)
    return r.mean().expand_as(r), r.std(correction=1).expand_as(r)


def _leave_one_out(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = r.numel()
    if _all_equal(r):
        return r.clone(), torch.zeros_like(r)
    # Row i holds the n-1 rewards other than r[i].
    others = r.expand(n, n)[~torch.eye(n, dtype=torch.bool)].view(n, n - 1)
    if n - 1 < 2:
        return others.mean(dim=1), torch.zeros_like(r)
    std = others.std(dim=1, correction=1)
    std[others.amax(dim=1) == others.amin(dim=1)] = 0.0
    return others.mean(dim=1), std


def _all_equal(r: torch.Tensor) -> bool:
    return bool((r == r[0]).all())


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    leave_one_out: bool,
    normalize: bool,
    clip_low: float | None = None,
    clip_high: float | None = None,
) -> torch.Tensor:
    """Advantages [B] in ``rewards``' dtype: ``r - baseline``, divided by ``std + 1e-6`` where
    ``normalize`` and the std is > 0, then clamped to ``[clip_low, clip_high]`` (None: no bound)."""
    baseline, std = baseline_and_std(rewards, group_ids, leave_one_out=leave_one_out)
    adv = rewards.detach().to(torch.float64) - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + STD_EPSILON), adv)
    if clip_low is not None or clip_high is not None:
        adv = adv.clamp(min=clip_low, max=clip_high)
    return adv.to(rewards.dtype)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, config: GRPOConfig) -> torch.Tensor:
    """:func:`compute_advantages` with the options of a ``grpo`` section."""
    return compute_advantages(
        rewards,
        group_ids,
        leave_one_out=config.baseline == "leave_one_out",
        normalize=config.normalize_rewards,
        clip_low=config.advantage_clip_low,
        clip_high=config.advantage_clip_high,
    )
