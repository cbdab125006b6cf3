"""Reward scaling, DAPO overlong shaping and overlong filtering, by hand."""

from __future__ import annotations

import pytest
import torch

from posttrain_grpo.config import RewardScalingConfig
from posttrain_grpo.rewards import mask_truncated, overlong_penalty, scale_rewards


def test_scale_rewards_clamps_then_maps_linearly():
    # [0, 1] -> [-1, 1]: clamp gives 0, 0.25, 1, 1, 0; then -1 + 2 * r.
    rewards = torch.tensor([0.0, 0.25, 1.0, 1.5, -2.0])
    config = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    assert scale_rewards(rewards, config).tolist() == [-1.0, -0.5, 1.0, 1.0, -1.0]


def test_scale_rewards_off_is_identity():
    rewards = torch.tensor([5.0, -3.0])
    assert scale_rewards(rewards, RewardScalingConfig(enabled=False, source_max=2.0, target_max=10.0)) is rewards


def test_overlong_penalty_by_hand():
    # L = 10, C = 4: free up to 6 tokens; excess 0, 0, 1, 2, 4, 6 -> /4, capped at 1 ->
    # 0, 0, 0.25, 0.5, 1, 1; times -penalty (0.5).
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    got = overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_mask_truncated():
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    truncated = torch.tensor([True, False, True, False])
    assert mask_truncated(sample_mask, truncated).tolist() == [0.0, 1.0, 0.0, 1.0]


def test_overlong_penalty_grows_linearly_past_the_maximum():
    # L = 10, C = 4, as above: past 10 tokens the linear form keeps the slope -0.5 / 4 per token
    # (12 tokens: excess 6 -> -0.75; NeMo RL's DAPO shaping), the capped one stays at -0.5.
    lengths = torch.tensor([6, 8, 10, 12, 18])
    linear = overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty=0.5, beyond_max="linear")
    assert linear.tolist() == pytest.approx([0.0, -0.25, -0.5, -0.75, -1.5])
    capped = overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty=0.5)
    assert capped.tolist() == pytest.approx([0.0, -0.25, -0.5, -0.5, -0.5])
