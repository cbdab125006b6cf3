"""Driver-side plan of a pass: which samples each data-parallel rank gets, and its microbatches.

Pure functions of the sample lengths. Every rank must run the same number of microbatches
(each forward and backward holds FSDP collectives), so the plan equalises the counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from posttrain.batch import (
    Batch,
    balanced_shard_indices,
    equalize_microbatch_counts,
    pack_bins,
    shard_indices,
    token_budget_microbatches,
)


@attrs.frozen
class Batching:
    """How a rank's samples are grouped into microbatches.

    Exactly one mode applies: ``packing_tokens_per_row`` (each microbatch is what fits in
    one packed row), ``dynamic_max_tokens`` (each microbatch fits a padded-token budget), or
    neither (``micro_batch_size`` samples per microbatch, in order).
    """

    micro_batch_size: int
    packing_tokens_per_row: int | None = None
    dynamic_max_tokens: int | None = None
    round_to: int = 1

    def __attrs_post_init__(self) -> None:
        if self.packing_tokens_per_row is not None and self.dynamic_max_tokens is not None:
            raise ValueError("sequence packing and dynamic batching are exclusive; enable one")


@attrs.frozen
class PassPlan:
    """``shards[r]``: global sample indices of data-parallel rank ``r``;
    ``microbatches[r]``: lists of indices into that shard, one list per microbatch."""

    shards: list[list[int]]
    microbatches: list[list[list[int]]]
    batching: Batching

    def work(self, batch: Batch) -> list[RankWork]:
        """What each data-parallel rank receives for ``batch``."""
        return [
            RankWork(batch.select(idx), mbs, self.batching)
            for idx, mbs in zip(self.shards, self.microbatches, strict=True)
        ]


@attrs.frozen
class RankWork:
    """One data-parallel rank's samples, its microbatches (index lists into ``batch``) and
    the batching they were planned with (a packed plan is run as packed rows)."""

    batch: Batch
    microbatches: list[list[int]]
    batching: Batching


def plan_pass(lengths: Sequence[int], dp_size: int, batching: Batching, row_group_size: int = 1) -> PassPlan:
    """Shard ``len(lengths)`` samples (a multiple of ``dp_size``) over the ranks and split
    each shard into microbatches; every rank gets the same number of microbatches.

    With ``row_group_size`` g > 1 (the loss's :attr:`~posttrain.interfaces.loss.LossFunction.row_group_size`)
    rows ``k*g .. k*g+g-1`` are planned as one unit: on one rank, in one microbatch, adjacent
    and in order."""
    lengths = [int(n) for n in lengths]
    if row_group_size > 1:
        return _plan_groups(lengths, dp_size, batching, row_group_size)
    if batching.packing_tokens_per_row is None and batching.dynamic_max_tokens is None:
        shards = shard_indices(len(lengths), dp_size)
        per_rank = [_fixed_microbatches(len(shard), batching.micro_batch_size) for shard in shards]
        return PassPlan(shards, per_rank, batching)
    shards = balanced_shard_indices(lengths, dp_size)
    per_rank = []
    for shard in shards:
        local = [lengths[i] for i in shard]
        if batching.packing_tokens_per_row is not None:
            per_rank.append(pack_bins(local, batching.packing_tokens_per_row))
        else:
            per_rank.append(token_budget_microbatches(local, batching.dynamic_max_tokens, batching.round_to))
    return PassPlan(shards, equalize_microbatch_counts(per_rank), batching)


def _plan_groups(lengths: list[int], dp_size: int, batching: Batching, g: int) -> PassPlan:
    """:func:`plan_pass` over groups of ``g`` rows: a group weighs its summed length for
    sharding and packing, and its longest row times ``g`` against a dynamic token budget."""
    groups = len(lengths) // g
    if len(lengths) % g or groups % dp_size:
        raise ValueError(
            f"{len(lengths)} rows in groups of {g} (the loss's row_group_size) cannot be split evenly over "
            f"{dp_size} data-parallel ranks: the row count must be a multiple of {g * dp_size}"
        )
    if batching.packing_tokens_per_row is None and batching.micro_batch_size % g:
        raise ValueError(f"micro batch size {batching.micro_batch_size} must be a multiple of the loss's row_group_size {g}")
    rows = [lengths[k * g:(k + 1) * g] for k in range(groups)]
    if batching.dynamic_max_tokens is not None:
        unit_lengths = [max(r) for r in rows]
        units = attrs.evolve(batching, micro_batch_size=batching.micro_batch_size // g,
                             dynamic_max_tokens=max(1, batching.dynamic_max_tokens // g))
    else:
        unit_lengths = [sum(r) for r in rows]
        units = attrs.evolve(batching, micro_batch_size=max(1, batching.micro_batch_size // g))
    if batching.packing_tokens_per_row is not None and max(unit_lengths) > batching.packing_tokens_per_row:
        k = unit_lengths.index(max(unit_lengths))
        raise ValueError(
            f"rows {k * g}..{k * g + g - 1} must be packed together (row_group_size {g}) and have {unit_lengths[k]} "
            f"tokens, more than the packing budget of {batching.packing_tokens_per_row} tokens per row; raise "
            "policy.sequence_packing.max_tokens_per_row or shorten the sequences"
        )
    plan = plan_pass(unit_lengths, dp_size, units)

    def expand(unit_indices: list[int]) -> list[int]:
        return [u * g + j for u in unit_indices for j in range(g)]

    return PassPlan([expand(s) for s in plan.shards], [[expand(mb) for mb in mbs] for mbs in plan.microbatches], batching)


def _fixed_microbatches(n: int, size: int) -> list[list[int]]:
    if size <= 0:
        raise ValueError(f"micro batch size must be positive, got {size}")
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]
