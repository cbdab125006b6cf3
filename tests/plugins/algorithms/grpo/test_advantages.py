"""Group baselines, std normalisation and clipping on groups computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain_grpo.advantages import (
    STD_EPSILON,
    baseline_and_std,
    compute_advantages,
    consecutive_group_ids,
    grpo_advantages,
)
from posttrain_grpo.config import GRPOConfig

F64 = torch.float64


def advantages(rewards, *, leave_one_out, normalize, group_size=None, **clip):
    r = torch.tensor(rewards, dtype=F64)
    ids = consecutive_group_ids(len(rewards), group_size or len(rewards))
    return compute_advantages(r, ids, leave_one_out=leave_one_out, normalize=normalize, **clip)


def test_consecutive_group_ids():
    assert consecutive_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="7 samples do not split into groups of 3"):
        consecutive_group_ids(7, 3)


def test_mean_baseline_by_hand():
    # rewards 3, 1, 0, 2: mean 1.5 -> r - b = 1.5, -0.5, -1.5, 0.5.
    # unbiased std: (2.25 + 0.25 + 2.25 + 0.25) / 3 = 5/3 -> std = sqrt(5/3) = 1.2909944.
    raw = advantages([3, 1, 0, 2], leave_one_out=False, normalize=False)
    assert raw.tolist() == [1.5, -0.5, -1.5, 0.5]
    normalized = advantages([3, 1, 0, 2], leave_one_out=False, normalize=True)
    std = math.sqrt(5 / 3)
    expected = [1.5 / (std + 1e-6), -0.5 / (std + 1e-6), -1.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert normalized.tolist() == pytest.approx(expected, rel=1e-12)


def test_leave_one_out_baseline_by_hand():
    # rewards 3, 1, 0, 2; each baseline is the mean of the other three, each std the
    # unbiased std of those three (divide the squared deviations by 3 - 1 = 2):
    #   i=0: others 1, 0, 2 -> b = 1,   A = 3 - 1 = 2;      devs 0, -1, 1        -> var 2/2 = 1,        std 1
    #   i=1: others 3, 0, 2 -> b = 5/3, A = 1 - 5/3 = -2/3; devs 4/3, -5/3, 1/3  -> var (42/9)/2 = 7/3, std sqrt(7/3)
    #   i=2: others 3, 1, 2 -> b = 2,   A = 0 - 2 = -2;     devs 1, -1, 0        -> var 1,              std 1
    #   i=3: others 3, 1, 0 -> b = 4/3, A = 2 - 4/3 = 2/3;  devs 5/3, -1/3, -4/3 -> var 7/3,            std sqrt(7/3)
    baseline, std = baseline_and_std(
        torch.tensor([3.0, 1.0, 0.0, 2.0]), torch.zeros(4, dtype=torch.long), leave_one_out=True
    )
    assert baseline.tolist() == pytest.approx([1, 5 / 3, 2, 4 / 3], rel=1e-12)
    assert std.tolist() == pytest.approx([1, math.sqrt(7 / 3), 1, math.sqrt(7 / 3)], rel=1e-12)
    raw = advantages([3, 1, 0, 2], leave_one_out=True, normalize=False)
    assert raw.tolist() == pytest.approx([2, -2 / 3, -2, 2 / 3], rel=1e-12)
    normalized = advantages([3, 1, 0, 2], leave_one_out=True, normalize=True)
    s7 = math.sqrt(7 / 3) + 1e-6
    assert normalized.tolist() == pytest.approx(
        [2 / (1 + 1e-6), (-2 / 3) / s7, -2 / (1 + 1e-6), (2 / 3) / s7], rel=1e-12
    )


def test_leave_one_out_lone_correct_sample():
    # rewards 1, 0, 0, 0:
    #   i=0: others 0, 0, 0 -> b = 0, std 0 (no division) -> A = 1
    #   i>0: others 1, 0, 0 -> b = 1/3, A = -1/3; devs 2/3, -1/3, -1/3 -> var (6/9)/2 = 1/3,
    #        std = sqrt(1/3) -> A = (-1/3) / sqrt(1/3) = -sqrt(1/3) (plus the 1e-6 epsilon)
    normalized = advantages([1, 0, 0, 0], leave_one_out=True, normalize=True)
    s = math.sqrt(1 / 3)
    assert normalized[0].item() == 1.0
    assert normalized[1:].tolist() == pytest.approx([(-1 / 3) / (s + 1e-6)] * 3, rel=1e-12)


def test_leave_one_out_pairs_have_no_std():
    # Two generations: each baseline is the other reward; one other sample has no std.
    assert advantages([1, 0], leave_one_out=True, normalize=True).tolist() == [1.0, -1.0]


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_constant_groups_get_exactly_zero_without_division(leave_one_out):
    # 0.1 + 0.1 + 0.1 is not 0.3 in floating point: a mean-based std would be ~1e-17, not 0,
    # and dividing by it would turn rounding noise into an advantage.
    rewards = [0.1, 0.1, 0.1, 1.0, 0.0, 1.0]
    adv = advantages(rewards, leave_one_out=leave_one_out, normalize=True, group_size=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all() and (adv[3:] != 0).all()
    _, std = baseline_and_std(
        torch.tensor(rewards, dtype=F64), consecutive_group_ids(6, 3), leave_one_out=leave_one_out
    )
    assert std[:3].tolist() == [0.0, 0.0, 0.0]


def test_singleton_groups_get_zero():
    assert advantages([0.3, 0.9], leave_one_out=False, normalize=True, group_size=1).tolist() == [0.0, 0.0]


def test_explicit_group_ids_match_consecutive_layout():
    rewards = torch.tensor([3.0, 5.0, 1.0, 6.0, 0.0, 4.0, 2.0, 7.0])
    interleaved = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # group 0: 3, 1, 0, 2; group 1: 5, 6, 4, 7
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    for loo in (False, True):
        got = compute_advantages(rewards, interleaved, leave_one_out=loo, normalize=True)
        expected = compute_advantages(rewards[order], consecutive_group_ids(8, 4), leave_one_out=loo, normalize=True)
        torch.testing.assert_close(got[order], expected, rtol=0, atol=0)


def test_clipping_and_dtype():
    # mean baseline of 3, 1, 0, 2 gives 1.5, -0.5, -1.5, 0.5; clamp to [-0.5, 1.0].
    rewards = torch.tensor([3.0, 1.0, 0.0, 2.0], dtype=torch.float32)
    adv = compute_advantages(
        rewards, torch.zeros(4, dtype=torch.long), leave_one_out=False, normalize=False, clip_low=-0.5, clip_high=1.0
    )
    assert adv.dtype == torch.float32 and adv.tolist() == [1.0, -0.5, -0.5, 0.5]
    high_only = compute_advantages(
        rewards, torch.zeros(4, dtype=torch.long), leave_one_out=False, normalize=False, clip_high=1.0
    )
    assert high_only.tolist() == [1.0, -0.5, -1.5, 0.5]


def test_grpo_advantages_reads_the_config():
    rewards = torch.tensor([3.0, 1.0, 0.0, 2.0])
    ids = torch.zeros(4, dtype=torch.long)
    config = GRPOConfig(baseline="mean", normalize_rewards=False, advantage_clip_low=-1.0)
    assert grpo_advantages(rewards, ids, config).tolist() == [1.5, -0.5, -1.0, 0.5]
    loo = grpo_advantages(rewards, ids, GRPOConfig())  # defaults: leave-one-out, normalised
    assert loo[0].item() == pytest.approx(2 / (1 + STD_EPSILON))


def test_batch_std_and_epsilon_by_hand():
    """reward_std_scope=batch: group-mean advantages over the unbiased std of every reward.
    Groups (1, 0) and (1, 1): A = 0.5, -0.5, 0, 0; rewards 1, 0, 1, 1 have std 0.5."""
    ids = consecutive_group_ids(4, 2)
    adv = compute_advantages(torch.tensor([1.0, 0, 1, 1], dtype=F64), ids, leave_one_out=False, normalize=True,
                             std_scope="batch", std_epsilon=1e-4)
    assert adv.tolist() == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0], rel=1e-12)
    group = compute_advantages(torch.tensor([1.0, 0, 1, 1], dtype=F64), ids, leave_one_out=False, normalize=True,
                               std_epsilon=1e-4)  # group std of (1, 0): sqrt(0.5)
    assert group[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), rel=1e-12)


def test_valid_samples_only_in_the_baseline():
    """With valid (1, 1, 0, 1) in one group of rewards (3, 1, 5, 2): the baseline of the mean
    form is the mean of 3, 1, 2 = 2, and the invalid sample gets 0. Leave-one-out: sample 0's
    baseline is (1 + 2) / 2. A group with one valid sample gets 0 everywhere."""
    rewards = torch.tensor([3.0, 1.0, 5.0, 2.0], dtype=F64)
    valid = torch.tensor([True, True, False, True])
    ids = torch.zeros(4, dtype=torch.long)
    mean = compute_advantages(rewards, ids, leave_one_out=False, normalize=False, valid=valid)
    assert mean.tolist() == [1.0, -1.0, 0.0, 0.0]
    loo = compute_advantages(rewards, ids, leave_one_out=True, normalize=False, valid=valid)
    assert loo.tolist() == pytest.approx([3 - 1.5, 1 - 2.5, 0.0, 2 - 2.0])
    normalized = compute_advantages(rewards, ids, leave_one_out=False, normalize=True, valid=valid)
    assert normalized[0].item() == pytest.approx(1 / (1 + STD_EPSILON))  # std of 3, 1, 2 is 1
    lone = compute_advantages(rewards, ids, leave_one_out=False, normalize=True, valid=torch.tensor([1, 0, 0, 0]) > 0)
    assert lone.tolist() == [0.0] * 4


def test_whitening_by_hand():
    """Raw rewards 1, 0, 0, 0 (baseline none): samples whitening gives (r - 0.25) / std with the
    unbiased std sqrt(0.25); tokens whitening weighs them by tokens 1, 1, 1, 5: mean 1/8,
    biased variance (7/8)^2 / 8 + 7 (1/8)^2 / 8 = 7/64."""
    rewards = torch.tensor([1.0, 0, 0, 0], dtype=F64)
    ids = consecutive_group_ids(4, 2)
    samples = compute_advantages(rewards, ids, leave_one_out=False, normalize=False, subtract_baseline=False,
                                 whiten="samples")
    assert samples.tolist() == pytest.approx([0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5], rel=1e-12)
    tokens = compute_advantages(rewards, ids, leave_one_out=False, normalize=False, subtract_baseline=False,
                                whiten="tokens", token_counts=torch.tensor([1, 1, 1, 5]))
    std = math.sqrt(7 / 64)
    assert tokens.tolist() == pytest.approx([(7 / 8) / std] + [(-1 / 8) / std] * 3, rel=1e-12)
    trained_only = compute_advantages(rewards, ids, leave_one_out=False, normalize=False, subtract_baseline=False,
                                      whiten="samples", trained=torch.tensor([True, True, True, False]))
    assert trained_only[:3].tolist() == pytest.approx([(2 / 3) / math.sqrt(1 / 3), (-1 / 3) / math.sqrt(1 / 3),
                                                       (-1 / 3) / math.sqrt(1 / 3)], rel=1e-12)


def test_grpo_advantages_reads_the_new_options():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    ids = consecutive_group_ids(4, 2)
    raw = GRPOConfig(baseline="none", normalize_rewards=False)
    assert grpo_advantages(rewards, ids, raw).tolist() == [1.0, 0.0, 1.0, 1.0]
    batch_std = GRPOConfig(baseline="mean", reward_std_scope="batch", advantage_std_epsilon=0.0)
    assert grpo_advantages(rewards, ids, batch_std).tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    valid_only = GRPOConfig(baseline="mean", normalize_rewards=False, baseline_valid_only=True)
    trained = torch.tensor([True, False, True, True])
    assert grpo_advantages(rewards, ids, valid_only, trained=trained).tolist() == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="whiten_advantages=tokens needs each sample's token count"):
        grpo_advantages(rewards, ids, GRPOConfig(whiten_advantages="tokens"))
