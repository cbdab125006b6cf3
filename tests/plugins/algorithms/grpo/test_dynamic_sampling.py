"""Dynamic sampling keeps whole informative groups, fills a step across generation batches,
drops surplus groups whole, and stops with a precise error."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain_grpo.advantages import compute_advantages, consecutive_group_ids
from posttrain_grpo.dynamic_sampling import DynamicSampler, DynamicSamplingError, groups_with_signal


def gen_batch(tag: str, rewards: list[float], group_size: int = 2) -> Batch:
    """A generation batch whose rows are named ``<tag><group>.<sample>``; response widths
    differ between batches so concatenation has to pad."""
    n = len(rewards)
    width = 3 + len(tag)
    return Batch(
        name=[f"{tag}{i // group_size}.{i % group_size}" for i in range(n)],
        rewards=torch.tensor(rewards),
        output_ids=torch.full((n, width), 7),
    )


def test_groups_with_signal():
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.6])
    assert groups_with_signal(rewards, 3).tolist() == [False, True, False, True]


def test_fills_across_batches_in_order():
    sampler = DynamicSampler(num_prompts=3, group_size=2, max_gen_batches=5)
    first = gen_batch("a", [1, 1, 0, 1, 0, 0])  # only group a1 differs
    sampler.add(first, first["rewards"])
    assert not sampler.done
    second = gen_batch("bb", [1, 0, 1, 1, 0, 1])  # groups bb0 and bb2 differ
    sampler.add(second, second["rewards"])
    assert sampler.done
    step = sampler.take(pad_values={"output_ids": -1})
    assert step["name"] == ["a1.0", "a1.1", "bb0.0", "bb0.1", "bb2.0", "bb2.1"]
    assert step["rewards"].tolist() == [0, 1, 1, 0, 0, 1]
    assert step["output_ids"][:2].tolist() == [[7, 7, 7, 7, -1], [7, 7, 7, 7, -1]]  # padded to the wider batch
    assert sampler.metrics() == {
        "dynamic_sampling/gen_batches": 2.0,
        "dynamic_sampling/groups_generated": 6.0,
        "dynamic_sampling/groups_with_signal": 3.0,
        "dynamic_sampling/groups_surplus": 0.0,
    }


def test_surplus_groups_are_dropped_whole():
    sampler = DynamicSampler(num_prompts=2, group_size=2, max_gen_batches=5)
    first = gen_batch("a", [0, 1, 0, 0])
    sampler.add(first, first["rewards"])
    second = gen_batch("b", [1, 0, 0, 1, 1, 1])
    sampler.add(second, second["rewards"])
    step = sampler.take()
    assert step["name"] == ["a0.0", "a0.1", "b0.0", "b0.1"]  # b1 kept but over the target
    assert sampler.metrics()["dynamic_sampling/groups_surplus"] == 1.0


def test_signal_rewards_decide_not_the_batch_rewards():
    """The loop passes rewards before overlong shaping: a group that differs only by a
    length penalty carries no signal."""
    sampler = DynamicSampler(num_prompts=1, group_size=2, max_gen_batches=2)
    batch = gen_batch("a", [0.0, -0.25, 1.0, 0.0])  # shaped rewards
    sampler.add(batch, signal_rewards=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert sampler.take()["name"] == ["a1.0", "a1.1"]


def test_kept_advantages_equal_advantages_of_the_kept_groups_alone():
    """Group rule: baselines computed before filtering remain those of the trained samples."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.5])
    adv = compute_advantages(rewards, consecutive_group_ids(12, 4), leave_one_out=True, normalize=True)
    batch = Batch(rewards=rewards, advantages=adv)
    sampler = DynamicSampler(num_prompts=2, group_size=4, max_gen_batches=1)
    sampler.add(batch, rewards)
    step = sampler.take()
    recomputed = compute_advantages(step["rewards"], consecutive_group_ids(8, 4), leave_one_out=True, normalize=True)
    torch.testing.assert_close(step["advantages"], recomputed, rtol=0, atol=0)
    assert step["advantages"][0] > 0  # the lone correct answer of group 0 is kept


def test_error_after_max_gen_batches():
    sampler = DynamicSampler(num_prompts=4, group_size=2, max_gen_batches=2)
    first = gen_batch("a", [1, 1, 0, 1, 0, 0])
    sampler.add(first, first["rewards"])
    second = gen_batch("b", [1, 1, 1, 1, 1, 0])
    with pytest.raises(DynamicSamplingError) as info:
        sampler.add(second, second["rewards"])
    assert str(info.value) == (
        "dynamic sampling: after 2 generation batches (grpo.dynamic_sampling.max_gen_batches=2) only 2 of the "
        "4 prompts needed per step had rewards that differ between their generations (6 prompts generated, 4 "
        "with identical rewards). Raise grpo.dynamic_sampling.max_gen_batches, lower grpo.num_prompts_per_step, "
        "or use prompts the policy solves only sometimes."
    )


def test_filling_on_the_last_allowed_batch_is_fine():
    sampler = DynamicSampler(num_prompts=2, group_size=2, max_gen_batches=2)
    for tag, rewards in (("a", [0, 1, 1, 1]), ("b", [1, 0, 0, 0])):
        batch = gen_batch(tag, rewards)
        sampler.add(batch, batch["rewards"])
    assert sampler.take()["name"] == ["a0.0", "a0.1", "b0.0", "b0.1"]


def test_misuse_is_refused():
    sampler = DynamicSampler(num_prompts=1, group_size=2, max_gen_batches=3)
    with pytest.raises(RuntimeError, match="only 0 of 1 groups collected"):
        sampler.take()
    batch = gen_batch("a", [0, 1, 1])
    with pytest.raises(ValueError, match=r"rewards of shape \(3,\) do not split into groups of 2"):
        sampler.add(batch, batch["rewards"])
    batch = gen_batch("a", [0, 1])
    sampler.add(batch, batch["rewards"])
    with pytest.raises(RuntimeError, match="already full"):
        sampler.add(batch, batch["rewards"])
