"""DAPO dynamic sampling: fill a step with prompt groups that carry a learning signal.

The rule is decided per group: a prompt's group of generations is kept if and only if its
rewards are not all equal. NeMo RL instead keeps each *sample* whose (leave-one-out) std is
non-zero; we prefer the group rule because:

- the group is the unit the baseline is computed over. Keeping or dropping groups whole
  keeps every kept sample's baseline made of samples that are also trained on, and keeps
  the step a whole number of groups (so ``num_prompts_per_step * num_generations_per_prompt``
  and its divisibility by ``policy.train_global_batch_size`` hold);
- with a leave-one-out std the per-sample rule can drop exactly the informative sample: in
  a group with rewards [1, 0, 0, 0] the correct answer's others are all 0 (std 0), so it
  is dropped while its three wrong peers are kept, and the step learns only "not these";
- it loses nothing: in a constant group every sample's advantage is exactly 0 under either
  baseline, and in any other group we keep every sample, including all non-zero advantages.

With the mean baseline the two rules coincide. Decide on the rewards *before* overlong
shaping (length penalties would make an all-wrong group look informative), and without the
samples the environments could not score (their signal is NaN): their group carries signal
when its scored samples differ.

The sampler sees sample keys and their signal rewards only: the GRPO loop writes every
rollout into the step's data-plane partition with the signal reward as a tag, decides from
the tags, and fetches only the kept keys, so a dropped group's tensors are never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.errors import PosttrainError


class DynamicSamplingError(PosttrainError):
    """Too few informative prompt groups after the allowed number of generation batches."""


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [B / group_size]: True for each block of ``group_size`` consecutive samples whose
    rewards are not all equal. A NaN reward (a sample the environment could not score) is
    left out: the others must differ."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    scored = ~groups.isnan()
    highest = torch.where(scored, groups, -torch.inf).amax(dim=1)
    lowest = torch.where(scored, groups, torch.inf).amin(dim=1)
    return scored.sum(dim=1).ge(2) & (highest != lowest)


class DynamicSampler:
    """Accumulates generation batches until ``num_prompts`` informative groups are collected.

    Usage per step: ``while not sampler.done: sampler.add(keys, signal_rewards)`` for each
    generation batch, then ``sampler.take()`` for the keys to train on. Every added batch is
    laid out as consecutive groups of ``group_size`` samples; groups keep their order across
    batches, and groups beyond ``num_prompts`` are dropped whole.
    """

    def __init__(self, num_prompts: int, group_size: int, max_gen_batches: int):
        self.num_prompts = num_prompts
        self.group_size = group_size
        self.max_gen_batches = max_gen_batches
        self.gen_batches = 0
        self.groups_generated = 0
        self.groups_kept = 0
        self._kept: list[str] = []

    @property
    def done(self) -> bool:
        return self.groups_kept >= self.num_prompts

    def add(self, keys: Sequence[str], signal_rewards: torch.Tensor) -> None:
        """Keep the groups of the batch with sample ``keys`` whose ``signal_rewards`` (float
        [B]) are not all equal.

        Raises :class:`DynamicSamplingError` when this was generation batch number
        ``max_gen_batches`` and the step is still not full.
        """
        if self.done:
            raise RuntimeError("DynamicSampler.add() called after the step was already full; call take()")
        if len(keys) != signal_rewards.numel():
            raise ValueError(f"batch has {len(keys)} samples but signal_rewards has {signal_rewards.numel()}")
        keep = groups_with_signal(signal_rewards, self.group_size)
        self.gen_batches += 1
        self.groups_generated += keep.numel()
        self.groups_kept += int(keep.sum())
        rows = torch.arange(len(keys)).view(-1, self.group_size)[keep].flatten()
        self._kept.extend(keys[int(row)] for row in rows)
        if not self.done and self.gen_batches >= self.max_gen_batches:
            raise DynamicSamplingError(
                f"dynamic sampling: after {self.gen_batches} generation batches "
                f"(grpo.dynamic_sampling.max_gen_batches={self.max_gen_batches}) only {self.groups_kept} of the "
                f"{self.num_prompts} prompts needed per step had rewards that differ between their generations "
                f"({self.groups_generated} prompts generated, {self.groups_generated - self.groups_kept} with "
                f"identical rewards). Raise grpo.dynamic_sampling.max_gen_batches, lower "
                f"grpo.num_prompts_per_step, or use prompts the policy solves only sometimes."
            )

    def take(self) -> list[str]:
        """The keys of the first ``num_prompts`` kept groups, in generation order."""
        if not self.done:
            raise RuntimeError(f"DynamicSampler.take(): only {self.groups_kept} of {self.num_prompts} groups collected")
        return self._kept[: self.num_prompts * self.group_size]

    def metrics(self) -> dict[str, float]:
        """Counts for the step's logs."""
        return {
            "dynamic_sampling/gen_batches": float(self.gen_batches),
            "dynamic_sampling/groups_generated": float(self.groups_generated),
            "dynamic_sampling/groups_with_signal": float(self.groups_kept),
            "dynamic_sampling/groups_surplus": float(self.groups_kept - min(self.groups_kept, self.num_prompts)),
        }
