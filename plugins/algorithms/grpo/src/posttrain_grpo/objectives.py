"""The policy objective of :class:`~posttrain_grpo.loss.ClippedPGLoss`: the per-token loss
from the ratio ``r`` to the proximal policy and the advantage ``A``.

With ``low = 1 - ratio_clip_low``, ``high = 1 + ratio_clip_high``:

- ``ppo``: ``max(-A r, -A clip(r, low, high))``; dual clip (``dual_clip_c = c``): for
  ``A < 0``, at most ``-c A``;
- ``cispo``: ``-A sg(clip(r, low, high)) logp``: the clipped ratio weights the score
  function, so no token loses its gradient to the clip;
- ``sapo``: ``-A sigmoid(tau (r - 1)) 4 / tau``, ``tau = sapo_temperature_pos`` where
  ``A > 0`` and ``sapo_temperature_neg`` elsewhere: a smooth gate whose gradient is ``-A`` at
  ``r = 1`` and fades away from it;
- ``disable_ppo_ratio`` (REINFORCE): ``-A logp``.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.reduction import Reduction


def policy_ratio(cfg: ClippedPGConfig, logp: torch.Tensor, anchor: torch.Tensor, reduce: Reduction) -> torch.Tensor:
    """``r = exp(logp - anchor)`` [b, S] with gradient; GSPO (``sequence_level_ratio``): the
    exponential of each sequence's mean log-ratio, on every token of the sequence."""
    log_ratio = logp - anchor
    if cfg.sequence_level_ratio:
        log_ratio = reduce.sequence_mean(log_ratio)[:, None].expand_as(logp)
    return torch.exp(log_ratio)


def policy_objective(
    cfg: ClippedPGConfig,
    logp: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    reduce: Reduction,
    metrics: MutableMapping[str, torch.Tensor | float],
) -> torch.Tensor:
    """Per-token loss [b, S] of the configured objective (module docstring); its clip
    metrics go into ``metrics``."""
    if cfg.disable_ppo_ratio:
        return -adv * logp
    low, high = 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high
    if cfg.policy_loss == "cispo":
        metrics["clip_fraction_low"] = reduce.metric(ratio < low)
        metrics["clip_fraction_high"] = reduce.metric(ratio > high)
        return -adv * ratio.clamp(low, high).detach() * logp
    if cfg.policy_loss == "sapo":
        tau = torch.where(adv > 0, adv.new_tensor(cfg.sapo_temperature_pos), adv.new_tensor(cfg.sapo_temperature_neg))
        return -adv * torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    objective = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    metrics["clip_fraction_low"] = reduce.metric((adv < 0) & (ratio < low))
    metrics["clip_fraction_high"] = reduce.metric((adv > 0) & (ratio > high))
    if cfg.dual_clip_c is None:
        return objective
    bound = -cfg.dual_clip_c * adv
    binds = (adv < 0) & (objective > bound)
    metrics["dual_clip_fraction"] = reduce.metric(binds)
    return torch.where(binds, bound, objective)
