"""Dynamic sampling keeps whole informative groups (by sample key), fills a step across generation batches,
drops surplus groups whole, and stops with a precise error."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain_grpo.advantages import compute_advantages, consecutive_group_ids
from posttrain_grpo.dynamic_sampling import DynamicSampler, DynamicSamplingError, groups_with_signal


def gen_batch(tag: str, rewards: list[float], group_size: int = 2) -> tuple[list[str], torch.Tensor]:
    """A generation batch's sample keys, ``<tag><group>.<sample>``, and its rewards."""
    return [f"{tag}{i // group_size}.{i % group_size}" for i in range(len(rewards))], torch.tensor(rewards)


def test_groups_with_signal():
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.6])
    assert groups_with_signal(rewards, 3).tolist() == [False, True, False, True]


def test_samples_without_a_score_carry_no_signal():
    """NaN: a sample the environment could not score. A group has signal when its scored
    samples differ; two alike, or fewer than two, carry none."""
    nan = float("nan")
    rewards = torch.tensor([1, nan, 0, 1, nan, 1, nan, nan, 1, nan, nan, nan])
    assert groups_with_signal(rewards, 3).tolist() == [True, False, False, False]


def test_fills_across_batches_in_order():
    sampler = DynamicSampler(num_prompts=3, group_size=2, max_gen_batches=5)
    sampler.add(*gen_batch("a", [1, 1, 0, 1, 0, 0]))  # only group a1 differs
    assert not sampler.done
    sampler.add(*gen_batch("bb", [1, 0, 1, 1, 0, 1]))  # groups bb0 and bb2 differ
    assert sampler.done
    assert sampler.take() == ["a1.0", "a1.1", "bb0.0", "bb0.1", "bb2.0", "bb2.1"]
    assert sampler.metrics() == {
        "dynamic_sampling/gen_batches": 2.0,
        "dynamic_sampling/groups_generated": 6.0,
        "dynamic_sampling/groups_with_signal": 3.0,
        "dynamic_sampling/groups_surplus": 0.0,
    }


def test_surplus_groups_are_dropped_whole():
    sampler = DynamicSampler(num_prompts=2, group_size=2, max_gen_batches=5)
    sampler.add(*gen_batch("a", [0, 1, 0, 0]))
    sampler.add(*gen_batch("b", [1, 0, 0, 1, 1, 1]))
    assert sampler.take() == ["a0.0", "a0.1", "b0.0", "b0.1"]  # b1 kept but over the target
    assert sampler.metrics()["dynamic_sampling/groups_surplus"] == 1.0


def test_signal_rewards_decide_not_the_batch_rewards():
    """The loop passes rewards before overlong shaping: a group that differs only by a
    length penalty carries no signal."""
    sampler = DynamicSampler(num_prompts=1, group_size=2, max_gen_batches=2)
    keys, _shaped = gen_batch("a", [0.0, -0.25, 1.0, 0.0])
    sampler.add(keys, signal_rewards=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert sampler.take() == ["a1.0", "a1.1"]


def test_kept_advantages_equal_advantages_of_the_kept_groups_alone():
    """Group rule: baselines computed before filtering remain those of the trained samples."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.5])
    adv = compute_advantages(rewards, consecutive_group_ids(12, 4), leave_one_out=True, normalize=True)
    batch = Batch(rewards=rewards, advantages=adv)
    sampler = DynamicSampler(num_prompts=2, group_size=4, max_gen_batches=1)
    sampler.add([str(i) for i in range(12)], rewards)
    step = batch.select(torch.tensor([int(key) for key in sampler.take()]))
    recomputed = compute_advantages(step["rewards"], consecutive_group_ids(8, 4), leave_one_out=True, normalize=True)
    torch.testing.assert_close(step["advantages"], recomputed, rtol=0, atol=0)
    assert step["advantages"][0] > 0  # the lone correct answer of group 0 is kept


def test_error_after_max_gen_batches():
    sampler = DynamicSampler(num_prompts=4, group_size=2, max_gen_batches=2)
    sampler.add(*gen_batch("a", [1, 1, 0, 1, 0, 0]))
    with pytest.raises(DynamicSamplingError) as info:
        sampler.add(*gen_batch("b", [1, 1, 1, 1, 1, 0]))
    assert str(info.value) == (
        "dynamic sampling: after 2 generation batches (grpo.dynamic_sampling.max_gen_batches=2) only 2 of the "
        "4 prompts needed per step had rewards that differ between their generations (6 prompts generated, 4 "
        "with identical rewards). Raise grpo.dynamic_sampling.max_gen_batches, lower grpo.num_prompts_per_step, "
        "or use prompts the policy solves only sometimes."
    )


def test_filling_on_the_last_allowed_batch_is_fine():
    sampler = DynamicSampler(num_prompts=2, group_size=2, max_gen_batches=2)
    for tag, rewards in (("a", [0, 1, 1, 1]), ("b", [1, 0, 0, 0])):
        sampler.add(*gen_batch(tag, rewards))
    assert sampler.take() == ["a0.0", "a0.1", "b0.0", "b0.1"]


def test_misuse_is_refused():
    sampler = DynamicSampler(num_prompts=1, group_size=2, max_gen_batches=3)
    with pytest.raises(RuntimeError, match="only 0 of 1 groups collected"):
        sampler.take()
    with pytest.raises(ValueError, match=r"rewards of shape \(3,\) do not split into groups of 2"):
        sampler.add(*gen_batch("a", [0, 1, 1]))
    with pytest.raises(ValueError, match="batch has 2 samples but signal_rewards has 3"):
        sampler.add(["a0.0", "a0.1"], torch.tensor([0.0, 1.0, 1.0]))
    sampler.add(*gen_batch("a", [0, 1]))
    with pytest.raises(RuntimeError, match="already full"):
        sampler.add(*gen_batch("a", [0, 1]))
