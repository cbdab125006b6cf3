"""The driver side of a policy sharded over a worker group, shared by policy backends.

A pass (logprobs, top-k, train) is planned here from the sample lengths alone
(:func:`plan_pass`): which samples each data-parallel rank gets and how they are grouped
into microbatches; every rank runs the same number of microbatches (each forward and
backward may hold collectives). :class:`ShardedPolicy` sends each worker its replica's
:class:`RankWork`, takes one result per data-parallel rank and puts them back in the
batch's order. The batching fields of ``config.policy`` (micro batch sizes,
``sequence_packing``, ``dynamic_batching``) are read at every pass and travel with the
work, so the workers follow whatever the driver planned.

The worker class of a :class:`ShardedPolicy` provides: ``logprobs(work, reference)``,
``topk(work, k)``, ``train(work, loss_fn, eval_mode)``, ``save_checkpoint(path)``,
``load_checkpoint(path)``, ``export_hf(path, shard_bytes)``, ``weight_sizes()``,
``gather_weights(names)`` (collective; the tensors on rank 0), ``prepare_for_training()``,
``offload()`` and ``info()``.

Data from a plane: when an algorithm passes :class:`~posttrain.interfaces.PlaneSamples` and
the plane has a :meth:`~posttrain.interfaces.DataPlane.worker_handle`, the driver reads only
the samples' ``input_lengths`` to plan, and each rank's :class:`RankWork` names its keys
(:class:`ShardRef`) instead of carrying tensors: ``work.batch`` fetches them in the worker
on first use. A logprob pass then also carries a :class:`ResultSink`, and the worker writes
its results back to the plane (through :meth:`posttrain.distributed.Worker.run_work`, which
calls :meth:`RankWork.run`), so no logprob tensor reaches the driver. Workers need no code
for this: they read ``work.batch`` as always. Without a handle (the in-memory plane) the
driver materialises the batch and runs the ordinary pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from posttrain.backend.hf_export import bucket_names
from posttrain.batch import (
    Batch,
    balanced_shard_indices,
    equalize_microbatch_counts,
    pack_bins,
    shard_indices,
    token_budget_microbatches,
)
from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.distributed import WorkerGroup
from posttrain.interfaces.data_plane import PlaneSamples, WorkerPlaneHandle
from posttrain.interfaces.loss import LossFunction, combine_metrics
from posttrain.interfaces.policy import Policy

#: Largest safetensors shard :meth:`ShardedPolicy.export_hf` writes.
HF_SHARD_BYTES = 4 * 1024**3


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


@attrs.frozen
class ResultSink:
    """Where a worker stores a pass's result instead of returning it: field ``source`` of
    the result, rows ``rows`` of the shard, is written as ``field`` under those rows' keys.
    Only worker ``writer_rank`` writes (the others of its replica compute the same rows)."""

    field: str
    source: str
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

    def run(self, worker: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``worker.<method>(self, *args, **kwargs)`` in the worker's process; with a
        :attr:`sink`, store the result in the plane and return None instead."""
        result = getattr(worker, method)(self, *args, **kwargs)
        if self.sink is None:
            return result
        if worker.rank == self.sink.writer_rank:
            if result is None:
                raise RuntimeError(f"{method}() returned nothing on rank {worker.rank}, the rank meant to store it")
            if not isinstance(self.data, ShardRef):
                raise TypeError("a RankWork with a result sink must refer to its samples with a ShardRef")
            rows = list(self.sink.rows)
            self.data.handle.open().put(
                self.data.partition, [self.data.keys[i] for i in rows], {self.sink.field: result[self.sink.source][rows]}
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


def _padded_order(n: int, dp_size: int) -> list[int]:
    """Indices ``0..n-1`` then the last one repeated up to a multiple of ``dp_size``."""
    return list(range(n)) + [n - 1] * (-n % dp_size)


def _fixed_microbatches(n: int, size: int) -> list[list[int]]:
    if size <= 0:
        raise ValueError(f"micro batch size must be positive, got {size}")
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]


class ShardedPolicy(Policy):
    """A :class:`~posttrain.interfaces.Policy` run by ``group``, whose workers are
    data-parallel replicas of a (possibly model-parallel) model.

    ``dp_rank_of[r]`` is the data-parallel rank of worker ``r`` (it receives that rank's
    work); ``result_ranks[d]`` is the worker whose pass results stand for data-parallel
    rank ``d`` (the others return the same values, or None where only some ranks hold
    them, e.g. pipeline stages before the last).
    """

    def __init__(self, config: RunConfig, group: WorkerGroup, dp_rank_of: Sequence[int], result_ranks: Sequence[int]):
        self.config = config
        self.group = group
        self.dp_rank_of = list(dp_rank_of)
        self.result_ranks = list(result_ranks)
        self.dp_size = len(self.result_ranks)

    # ------------------------------------------------------------------ passes

    def _plan(self, lengths: Sequence[int], micro_batch_size: int, row_group_size: int = 1) -> PassPlan:
        batching = Batching.from_policy_config(self.config.policy, micro_batch_size)
        return plan_pass(lengths, self.dp_size, batching, row_group_size)

    def _run_pass(self, method: str, work: list[RankWork], *args: Any) -> tuple[list[Any], list[Any]]:
        """Run ``method`` on every worker with its replica's work; return the results of
        :attr:`result_ranks` (in data-parallel order) and all results. Work that refers to
        a plane runs through :meth:`RankWork.run` in the worker."""
        if any(isinstance(w.data, ShardRef) for w in work):
            method, args = "run_work", (method, *args)  # Worker.run_work(work, method, *args)
        results = self.group.run_sharded(method, work, *args, shard_of_rank=lambda rank: self.dp_rank_of[rank])
        return [results[r] for r in self.result_ranks], results

    def _inference_pass(self, method: str, batch: Batch, *args: Any) -> Batch:
        n = len(batch)
        if n == 0:
            raise ValueError(f"{method}: the batch is empty")
        padded = batch.select(_padded_order(n, self.dp_size))
        plan = self._plan(padded["input_lengths"].tolist(), self.config.policy.logprob_micro_batch_size)
        outputs, _ = self._run_pass(method, plan.work(padded), *args)
        return Batch.restore_order(outputs, plan.shards).slice(0, n)

    def _lengths(self, samples: PlaneSamples) -> list[int]:
        return samples.plane.get(samples.partition, samples.keys, ["input_lengths"])["input_lengths"].tolist()

    # ------------------------------------------------------------------ Policy

    def get_logprobs(self, batch: Batch) -> Batch:
        return self._inference_pass("logprobs", batch, False)

    def get_reference_policy_logprobs(self, batch: Batch) -> Batch:
        return self._inference_pass("logprobs", batch, True)

    def get_topk_logits(self, batch: Batch, k: int) -> Batch:
        return self._inference_pass("topk", batch, k)

    def logprobs_into(self, samples: PlaneSamples, field: str, *, reference: bool = False) -> None:
        handle = samples.plane.worker_handle()
        if handle is None:
            return super().logprobs_into(samples, field, reference=reference)
        n = len(samples)
        if n == 0:
            raise ValueError("logprobs: no samples")
        order = _padded_order(n, self.dp_size)
        padded = attrs.evolve(samples, keys=[samples.keys[i] for i in order])
        lengths = self._lengths(samples)
        plan = self._plan([lengths[i] for i in order], self.config.policy.logprob_micro_batch_size)
        source = "reference_logprobs" if reference else "logprobs"

        def sink(dp_rank: int, shard: list[int]) -> ResultSink:
            rows = [j for j, i in enumerate(shard) if i < n]  # padding rows repeat a sample stored elsewhere
            return ResultSink(field, source, rows, writer_rank=self.result_ranks[dp_rank])

        self._run_pass("logprobs", plan.work_by_reference(handle, padded, sink), reference)

    def train(self, batch: Batch, loss_fn: LossFunction, *, eval_mode: bool = False) -> dict[str, float]:
        plan = self._plan(batch["input_lengths"].tolist(), self.config.policy.train_micro_batch_size,
                          loss_fn.row_group_size)
        return self._train_pass(plan.work(batch), loss_fn, eval_mode)

    def train_from(self, samples: PlaneSamples, loss_fn: LossFunction, *, eval_mode: bool = False) -> dict[str, float]:
        handle = samples.plane.worker_handle()
        if handle is None:
            return super().train_from(samples, loss_fn, eval_mode=eval_mode)
        plan = self._plan(self._lengths(samples), self.config.policy.train_micro_batch_size, loss_fn.row_group_size)
        return self._train_pass(plan.work_by_reference(handle, samples), loss_fn, eval_mode)

    def _train_pass(self, work: list[RankWork], loss_fn: LossFunction, eval_mode: bool) -> dict[str, float]:
        results, everyone = self._run_pass("train", work, loss_fn, eval_mode)
        metrics = combine_metrics([r["metrics"] for r in results], loss_fn.metric_reductions)
        metrics.update(
            loss=sum(r["loss"] for r in results),
            lr=results[0]["lr"],
            num_tokens=results[0]["num_tokens"],
            step_time_s=max(r["step_time_s"] for r in everyone if r is not None),
        )
        if not eval_mode:
            metrics["grad_norm"] = results[0]["grad_norm"]
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self.group.run_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.group.run_all("load_checkpoint", path)

    def export_hf(self, path: str) -> None:
        self.group.run_all("export_hf", path, HF_SHARD_BYTES)

    def export_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        for names in bucket_names(self.group.run_rank0("weight_sizes"), bucket_bytes):
            yield self.group.run_all("gather_weights", names)[0]

    def prepare_for_training(self) -> None:
        self.group.run_all("prepare_for_training")

    def offload(self) -> None:
        self.group.run_all("offload")

    def info(self) -> dict[str, Any]:
        return self.group.run_rank0("info")

    def shutdown(self) -> None:
        self.group.shutdown()
