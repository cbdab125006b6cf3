"""What a policy pass sends each rank: the plan and the work items.

A pass (logprobs, top-k, train) is planned by the driver from the sample lengths alone
(:func:`plan_pass`): which samples each data-parallel rank gets and how they are grouped
into microbatches; every rank runs the same number of microbatches (each forward and
backward may hold collectives). Each rank receives a :class:`RankWork`: its samples (or a
:class:`ShardRef` to them in a data plane, fetched in the worker on first use), its
microbatches and the :class:`Batching` they were planned with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from posttrain.batch import (
    Batch,
    balanced_shard_indices,
    equalize_microbatch_counts,
    pack_bins,
    shard_indices,
    token_budget_microbatches,
)
from posttrain.config.schema import PolicyConfig
from posttrain.interfaces.data_plane import PlaneSamples, SampleMap, WorkerPlaneHandle


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

    @classmethod
    def from_policy_config(cls, p: PolicyConfig, micro_batch_size: int) -> Batching:
        """The batching ``policy.sequence_packing`` / ``policy.dynamic_batching`` ask for."""
        if p.sequence_packing.enabled:
            per_row = p.sequence_packing.max_tokens_per_row or p.max_total_sequence_length
            return cls(micro_batch_size, packing_tokens_per_row=per_row, round_to=p.sequence_packing.round_to)
        if p.dynamic_batching.enabled:
            return cls(micro_batch_size, dynamic_max_tokens=p.dynamic_batching.max_tokens_per_microbatch,
                       round_to=p.dynamic_batching.round_to)
        return cls(micro_batch_size)


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

    def work_by_reference(
        self,
        handle: WorkerPlaneHandle,
        samples: PlaneSamples,
        sink: Callable[[int, list[int]], ResultSink] | None = None,
    ) -> list[RankWork]:
        """What each data-parallel rank receives when it fetches ``samples`` (whose keys
        the plan's global indices index) itself; ``sink(d, shard)`` gives rank ``d``'s
        :class:`ResultSink`, if any."""
        return [
            RankWork(
                ShardRef(handle, samples.partition, [samples.keys[i] for i in idx], samples.fields),
                mbs,
                self.batching,
                sink(d, idx) if sink is not None else None,
            )
            for d, (idx, mbs) in enumerate(zip(self.shards, self.microbatches, strict=True))
        ]


@attrs.frozen
class ShardRef:
    """One rank's samples in a data plane: ``keys`` (in shard order; a key may repeat, e.g.
    padding to a multiple of the data-parallel size) of ``partition``, read as ``fields``."""

    handle: WorkerPlaneHandle
    partition: str
    keys: tuple[str, ...] = attrs.field(converter=tuple)
    fields: tuple[str, ...] = attrs.field(converter=tuple)

    def fetch(self) -> Batch:
        """The shard, fetched by this process from the plane (each distinct key once)."""
        distinct = list(dict.fromkeys(self.keys))
        batch = self.handle.open().get(self.partition, distinct, self.fields)
        if len(distinct) == len(self.keys):
            return batch
        row = {key: i for i, key in enumerate(distinct)}
        return batch.select([row[key] for key in self.keys])

    def map(self, fn: SampleMap) -> dict[str, float]:
        """Apply ``fn`` to the shard, fetched by this process, and write the fields it returns
        back under the shard's keys (which must be distinct); return its sums. An empty
        shard fetches nothing and sums to nothing."""
        if not self.keys:
            return {}
        fields, sums = fn(self.fetch())
        self.handle.open().put(self.partition, list(self.keys), fields)
        return dict(sums)


@attrs.frozen
class ResultSink:
    """Where a worker stores a pass's result instead of returning it: for each ``(field,
    source)`` of ``fields``, field ``source`` of the result, rows ``rows`` of the shard, is
    written as ``field`` under those rows' keys. Only worker ``writer_rank`` writes (the
    others of its replica compute the same rows)."""

    fields: tuple[tuple[str, str], ...] = attrs.field(converter=lambda pairs: tuple(tuple(p) for p in pairs))
    rows: tuple[int, ...] = attrs.field(converter=tuple)
    writer_rank: int


@attrs.frozen
class RankWork:
    """One data-parallel rank's samples, its microbatches (index lists into ``batch``) and
    the batching they were planned with (a packed plan is run as packed rows).

    ``data`` is the samples themselves, or a :class:`ShardRef` that :attr:`batch` fetches in
    the worker on first use. ``sink``, with a :class:`ShardRef`, makes :meth:`run` store the
    pass's result in the plane."""

    data: Batch | ShardRef
    microbatches: list[list[int]]
    batching: Batching
    sink: ResultSink | None = None
    _fetched: dict[str, Batch] = attrs.field(factory=dict, eq=False, repr=False, alias="_fetched")

    @property
    def batch(self) -> Batch:
        """The rank's samples (fetched from the plane once, when ``data`` is a reference)."""
        if isinstance(self.data, Batch):
            return self.data
        if "batch" not in self._fetched:
            self._fetched["batch"] = self.data.fetch()
        return self._fetched["batch"]

    def run(self, worker: Any, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the worker's ``method`` (its own override of it) on this work, in the worker's
        process; with a :attr:`sink`, store the result in the plane and return None instead."""
        result = getattr(worker, method.__name__)(self, *args, **kwargs)
        if self.sink is None:
            return result
        if worker.rank == self.sink.writer_rank:
            if result is None:
                raise RuntimeError(
                    f"{method.__name__}() returned nothing on rank {worker.rank}, the rank meant to store it"
                )
            if not isinstance(self.data, ShardRef):
                raise TypeError("a RankWork with a result sink must refer to its samples with a ShardRef")
            missing = [source for _, source in self.sink.fields if source not in result]
            if missing:
                raise KeyError(f"{method.__name__}() on rank {worker.rank} gives no {', '.join(missing)} to store")
            rows = list(self.sink.rows)
            self.data.handle.open().put(
                self.data.partition, [self.data.keys[i] for i in rows],
                {field: result[source][rows] for field, source in self.sink.fields},
            )
        return None


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


def padded_order(n: int, dp_size: int) -> list[int]:
    """Indices ``0..n-1`` then the last one repeated up to a multiple of ``dp_size``."""
    return list(range(n)) + [n - 1] * (-n % dp_size)


def _fixed_microbatches(n: int, size: int) -> list[list[int]]:
    if size <= 0:
        raise ValueError(f"micro batch size must be positive, got {size}")
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]
