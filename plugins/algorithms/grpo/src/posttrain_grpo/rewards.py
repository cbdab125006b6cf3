"""Reward transforms applied before advantages, and the overlong filter applied after.

Order in a step: :func:`scale_rewards`, then :func:`overlong_penalty` added to the scaled
rewards, then advantages; :func:`mask_truncated` then removes truncated responses from the
loss while they still count in their group's baseline.
"""

from __future__ import annotations

import torch

from posttrain_grpo.config import OverlongBeyondMax, RewardScalingConfig


def scale_rewards(rewards: torch.Tensor, config: RewardScalingConfig) -> torch.Tensor:
    """Clamp rewards to [source_min, source_max] and map that range linearly onto
    [target_min, target_max]; unchanged when scaling is disabled."""
    if not config.enabled:
        return rewards
    clamped = rewards.clamp(config.source_min, config.source_max)
    slope = (config.target_max - config.target_min) / (config.source_max - config.source_min)
    return config.target_min + (clamped - config.source_min) * slope


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    buffer_length: int,
    penalty: float,
    beyond_max: OverlongBeyondMax = "capped",
) -> torch.Tensor:
    """DAPO's soft overlong punishment (float32 [B], <= 0), to add to the rewards.

    With L = ``max_response_length`` and C = ``buffer_length`` (tokens): 0 for a response of
    at most L - C tokens, ``-penalty * (len - (L - C)) / C`` from L - C on: up to L tokens
    (``beyond_max: capped``, then ``-penalty``), or at any length (``linear``).
    """
    excess = (response_lengths.to(torch.float32) - (max_response_length - buffer_length)).clamp(min=0)
    fraction = excess / buffer_length
    return -penalty * (fraction.clamp(max=1.0) if beyond_max == "capped" else fraction)


def mask_truncated(sample_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: ``sample_mask * (1 - truncated)``, so responses cut off by the
    length limit carry no gradient."""
    return sample_mask * (1 - truncated.to(sample_mask.dtype))
