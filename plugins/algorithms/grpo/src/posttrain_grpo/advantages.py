"""Group-relative advantages: each sample's reward minus a baseline computed over the
other generations of the same prompt, optionally divided by a reward std, whitened over the
batch and clamped.

Groups are given as one integer id per sample (:func:`consecutive_group_ids` builds the ids
of the usual layout, ``num_generations_per_prompt`` consecutive samples per prompt). The
arithmetic runs in float64 per group, so a group whose rewards are all equal gets exactly
zero advantage and is never divided by its (zero) std.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain_grpo.config import AdvantageWhitening, GRPOConfig, RewardStdScope

#: Added to the std before dividing (only where the std is > 0), as NeMo RL does; TRL adds 1e-4.
STD_EPSILON = 1e-6


def consecutive_group_ids(num_samples: int, group_size: int) -> torch.Tensor:
    """Group ids ``[0]*group_size + [1]*group_size + ...`` (int64 [num_samples])."""
    if group_size < 1 or num_samples % group_size:
        raise ValueError(f"{num_samples} samples do not split into groups of {group_size}")
    return torch.arange(num_samples // group_size).repeat_interleave(group_size)


def baseline_and_std(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, leave_one_out: bool, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and reward std (float64 [B] each) within each sample's group.

    Mean baseline: the group mean and the group's unbiased std. Leave-one-out: the mean of
    the group's *other* samples and the unbiased std of those n-1 others (0 when there is
    only one other). A group of one sample, or whose rewards are all equal, gets baseline =
    reward and std 0; a std is also exactly 0 whenever the values it is taken over are equal.
    With ``valid`` (bool [B]) only a group's valid samples count, as if the others were not
    there; an invalid sample gets baseline = reward and std 0 (advantage 0).
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    r = rewards.detach().to(torch.float64)
    baseline = r.clone()
    std = torch.zeros_like(r)
    members = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    for gid in torch.unique(group_ids):
        idx = ((group_ids == gid) & members).nonzero().squeeze(1)
        if idx.numel() > 1:
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
    subtract_baseline: bool = True,
    std_scope: RewardStdScope = "group",
    std_epsilon: float = STD_EPSILON,
    valid: torch.Tensor | None = None,
    whiten: AdvantageWhitening | None = None,
    trained: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [B] in ``rewards``' dtype, in this order:

    1. ``r - baseline`` (:func:`baseline_and_std`, over the ``valid`` samples of each group
       when given); ``r`` itself without ``subtract_baseline``;
    2. with ``normalize``, divided by ``std + std_epsilon`` where the std is > 0: the
       baseline's std (``std_scope`` group) or the unbiased std of every (valid) sample's
       reward (``batch``);
    3. with ``whiten``, shifted and scaled to mean 0 and std 1 over the ``trained`` samples
       (bool [B], default all): ``samples`` weighs each once with the unbiased std;
       ``tokens`` weighs each by ``token_counts`` with the biased std (no scaling where the
       std is 0);
    4. clamped to ``[clip_low, clip_high]`` (None: no bound).
    """
    r = rewards.detach().to(torch.float64)
    baseline, std = baseline_and_std(rewards, group_ids, leave_one_out=leave_one_out, valid=valid)
    adv = r - baseline if subtract_baseline else r.clone()
    if normalize:
        if std_scope == "batch":
            pool = r if valid is None else r[valid.to(torch.bool)]
            std = (pool.std(correction=1) if pool.numel() > 1 else r.new_zeros(())).expand_as(r)
        adv = torch.where(std > 0, adv / (std + std_epsilon), adv)
    if whiten is not None:
        adv = _whiten(adv, trained, token_counts if whiten == "tokens" else None)
    if clip_low is not None or clip_high is not None:
        adv = adv.clamp(min=clip_low, max=clip_high)
    return adv.to(rewards.dtype)


def _whiten(adv: torch.Tensor, trained: torch.Tensor | None, token_counts: torch.Tensor | None) -> torch.Tensor:
    """``adv`` shifted and scaled over the ``trained`` samples: weighted by ``token_counts``
    with the biased variance, or each sample once with the unbiased one."""
    keep = torch.ones_like(adv, dtype=torch.bool) if trained is None else trained.to(torch.bool)
    if token_counts is None:
        values = adv[keep]
        if values.numel() == 0:
            return adv
        mean = values.mean()
        std = values.std(correction=1) if values.numel() > 1 else adv.new_zeros(())
    else:
        weights = torch.where(keep, token_counts.to(adv.dtype), 0.0)
        total = weights.sum()
        if total <= 0:
            return adv
        mean = (weights * adv).sum() / total
        std = ((weights * (adv - mean).square()).sum() / total).sqrt()
    return (adv - mean) / std if std > 0 else adv - mean


def normalize_then_sum(
    components: torch.Tensor,
    group_ids: torch.Tensor,
    weights: Sequence[float] | None = None,
    *,
    trained: torch.Tensor | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    **group_options: Any,
) -> torch.Tensor:
    """GDPO's advantages [B] from reward parts ``components`` [B, K]: each part's advantage
    by :func:`compute_advantages` (steps 1 and 2, with ``group_options``), their sum weighted
    by ``weights`` (None: all 1), whitened over the ``trained`` samples (each once, unbiased
    std), then clamped to ``[clip_low, clip_high]``."""
    if components.dim() != 2 or components.shape[0] != group_ids.shape[0]:
        raise ValueError(f"components must be [B, K] with B = {group_ids.shape[0]}, got {tuple(components.shape)}")
    weights = [1.0] * components.shape[1] if weights is None else list(weights)
    total = sum(
        weight * compute_advantages(components[:, k], group_ids, **group_options).to(torch.float64)
        for k, weight in enumerate(weights)
    )
    assert isinstance(total, torch.Tensor)
    adv = _whiten(total, trained, None)
    if clip_low is not None or clip_high is not None:
        adv = adv.clamp(min=clip_low, max=clip_high)
    return adv.to(components.dtype)


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    config: GRPOConfig,
    *,
    trained: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`compute_advantages` with the options of a ``grpo`` section, or
    :func:`normalize_then_sum` of reward parts ``rewards`` [B, K] with
    ``grpo.reward_aggregation: normalize_then_sum``; ``trained`` (bool [B]) marks the samples
    that train (the valid ones of ``grpo.baseline_valid_only``, the whitened ones),
    ``scored`` (bool [B], default all) the samples whose rewards are real: the others are in
    no baseline or std, whatever ``grpo.baseline_valid_only`` says, and get advantage 0
    before whitening (they must not train: ``trained`` excludes them), ``token_counts`` [B]
    their loss tokens (token whitening)."""
    if config.whiten_advantages == "tokens" and token_counts is None:
        raise ValueError("grpo.whiten_advantages=tokens needs each sample's token count")
    members = trained if config.baseline_valid_only else None
    if scored is not None:
        members = scored if members is None else members & scored
    group_options: dict[str, Any] = dict(
        leave_one_out=config.baseline == "leave_one_out",
        normalize=config.normalize_rewards,
        subtract_baseline=config.baseline != "none",
        std_scope=config.reward_std_scope,
        std_epsilon=config.advantage_std_epsilon,
        valid=members,
    )
    clip = dict(clip_low=config.advantage_clip_low, clip_high=config.advantage_clip_high)
    if config.reward_aggregation == "normalize_then_sum":
        return normalize_then_sum(rewards, group_ids, config.reward_weights, trained=trained, **clip, **group_options)
    return compute_advantages(rewards, group_ids, **group_options, **clip, whiten=config.whiten_advantages,
                              trained=trained, token_counts=token_counts)
