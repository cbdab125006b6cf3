"""The driver side of a policy sharded over a worker group, shared by policy backends.

:class:`ShardedPolicy` implements :class:`~posttrain.interfaces.Policy` over a
:class:`~posttrain.distributed.WorkerGroup` of :class:`~posttrain.backend.policy_worker.PolicyWorker`
ranks, calling the contract's methods by reference. A pass is planned here from the sample
lengths alone (:func:`~posttrain.backend.work.plan_pass`); each worker receives its replica's
:class:`~posttrain.backend.work.RankWork`, the driver takes one result per data-parallel rank
and puts them back in the batch's order. The batching fields of ``config.policy`` (micro
batch sizes, ``sequence_packing``, ``dynamic_batching``) are read at every pass and travel
with the work, so the workers follow whatever the driver planned.

Data from a plane: when an algorithm passes :class:`~posttrain.interfaces.PlaneSamples` and
the plane has a :meth:`~posttrain.interfaces.DataPlane.worker_handle`, the driver reads only
the samples' ``input_lengths`` to plan, and each rank's work names its keys
(:class:`~posttrain.backend.work.ShardRef`) instead of carrying tensors: ``work.batch`` fetches
them in the worker on first use. A logprob pass then also carries a
:class:`~posttrain.backend.work.ResultSink`, and the worker writes its results back to the
plane (through :meth:`posttrain.distributed.Worker.run_work`, which calls
:meth:`RankWork.run`), so no logprob tensor reaches the driver. Workers need no code for
this: they read ``work.batch`` as always. :meth:`ShardedPolicy.map_into` likewise sends each
replica's writing rank the keys of a contiguous shard (:meth:`PolicyWorker.map_shard`), and
only the map's sums come back. Without a handle (the in-memory plane) the driver
materialises the batch and runs the ordinary pass.

Placement: after :meth:`ShardedPolicy.offload` (colocated generation holds the devices) the
weights are off the training device until :meth:`ShardedPolicy.prepare_for_training`. A
forward or training pass meanwhile is refused (an algorithm calls ``prepare_for_training``
first). An export or a weight sync, whose gathers are collectives that must run where the
process group's tensors live (NCCL: the GPU), brings the state back for its duration and
offloads it again; checkpoints are written from wherever the state is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from posttrain.backend.hf_export import bucket_names
from posttrain.backend.hosted import HostedGroup
from posttrain.backend.policy_worker import PolicyWorker, RankTrainResult
from posttrain.backend.routing import ROUTES_FIELD, agreement_metrics
from posttrain.backend.work import Batching, PassPlan, RankWork, ResultSink, ShardRef, padded_order, plan_pass
from posttrain.batch import Batch
from posttrain.config.schema import RunConfig
from posttrain.config.validate import where_set
from posttrain.distributed import WorkerGroup
from posttrain.errors import ConfigError, PluginError
from posttrain.interfaces.data_plane import PlaneSamples, SampleMap
from posttrain.interfaces.generation import RefitStats, WeightEndpoint
from posttrain.interfaces.loss import LossFunction, combine_metrics
from posttrain.interfaces.policy import Policy

#: The loss input each ``policy.head`` needs a backend to compute (:attr:`PolicyWorker.loss_inputs`).
HEAD_INPUTS = {"lm": "logprobs", "value": "values"}
#: Largest safetensors shard :meth:`ShardedPolicy.export_hf` writes.
HF_SHARD_BYTES = 4 * 1024**3


class ShardedPolicy(Policy):
    """A :class:`~posttrain.interfaces.Policy` run by ``group``, whose workers are
    data-parallel replicas of a (possibly model-parallel) model.

    ``dp_rank_of[r]`` is the data-parallel rank of worker ``r`` (it receives that rank's
    work); ``result_ranks[d]`` is the worker whose pass results stand for data-parallel
    rank ``d`` (the others return the same values, or None where only some ranks hold
    them, e.g. pipeline stages before the last). ``reference`` False: the workers keep no
    initial weights (the factory's ``reference``), and a reference pass is refused.
    """

    def __init__(
        self,
        config: RunConfig,
        group: WorkerGroup[PolicyWorker],
        dp_rank_of: Sequence[int],
        result_ranks: Sequence[int],
        reference: bool = True,
    ):
        head, inputs = config.policy.head, group.worker_cls.loss_inputs
        built = [name for name, needs in HEAD_INPUTS.items() if needs in inputs]
        if head not in built:
            group.shutdown()
            raise ConfigError(
                f"policy.head: the {config.policy.backend} backend builds {' and '.join(built)} heads, not "
                f"'{head}'; use a backend that builds one (dtensor builds lm and value){where_set(config, 'policy.head')}"
            )
        self.config = config
        self.group = group
        self.dp_rank_of = list(dp_rank_of)
        self.result_ranks = list(result_ranks)
        self.dp_size = len(self.result_ranks)
        self.reference = reference
        self._weight_endpoint: tuple[WeightEndpoint, int] | None = None  # what the ranks are connected to
        self.offloaded = False  # offload() ran and prepare_for_training() has not since

    # ------------------------------------------------------------------ passes

    def _plan(self, lengths: Sequence[int], micro_batch_size: int, row_group_size: int = 1) -> PassPlan:
        batching = Batching.from_policy_config(self.config.policy, micro_batch_size)
        return plan_pass(lengths, self.dp_size, batching, row_group_size)

    def _run_pass(
        self, method: Callable[..., Any], work: list[RankWork], *args: Any
    ) -> tuple[list[Any], list[Any]]:
        """Run the worker ``method`` on every worker with its replica's work; return the
        results of :attr:`result_ranks` (in data-parallel order) and all results. Work that
        refers to a plane runs through :meth:`RankWork.run` in the worker."""
        if self.offloaded:
            raise PluginError(
                f"{method.__name__} pass of the worker group '{self.group.name}' while its weights are offloaded "
                "(offload() ran, as before colocated generation); call prepare_for_training() first"
            )
        if any(isinstance(w.data, ShardRef) for w in work):
            results = self.group.run_sharded(PolicyWorker.run_work, work, method, *args, shard_of_rank=self._dp_rank)
        else:
            results = self.group.run_sharded(method, work, *args, shard_of_rank=self._dp_rank)
        return [results[r] for r in self.result_ranks], results

    def _dp_rank(self, rank: int) -> int:
        return self.dp_rank_of[rank]

    def _inference_pass(self, method: Callable[..., Batch | None], batch: Batch, *args: Any) -> Batch:
        n = len(batch)
        if n == 0:
            raise ValueError(f"{method.__name__}: the batch is empty")
        padded = batch.select(padded_order(n, self.dp_size))
        plan = self._plan(padded["input_lengths"].tolist(), self.config.policy.logprob_micro_batch_size)
        outputs, _ = self._run_pass(method, plan.work(padded), *args)
        return Batch.restore_order(outputs, plan.shards).slice(0, n)

    def _lengths(self, samples: PlaneSamples) -> list[int]:
        return samples.plane.get(samples.partition, samples.keys, ["input_lengths"])["input_lengths"].tolist()

    # ------------------------------------------------------------------ Policy

    def _require_head(self, head: str, what: str) -> None:
        if self.config.policy.head != head:
            raise ConfigError(f"{what} needs policy.head '{head}'; this {self.config.policy.backend} policy was built "
                              f"with policy.head '{self.config.policy.head}'")

    def _require_reference(self) -> None:
        if not self.reference:
            raise PluginError(
                f"reference logprobs were asked of the worker group '{self.group.name}', which was built without "
                "reference weights (its factory's reference=False, from RunContext.build_policy(reference=False)); "
                "build it with reference=True to compute them"
            )

    def get_logprobs(self, batch: Batch) -> Batch:
        self._require_head("lm", "get_logprobs")
        return self._inference_pass(PolicyWorker.logprobs, batch, False)

    def get_reference_policy_logprobs(self, batch: Batch) -> Batch:
        self._require_head("lm", "get_reference_policy_logprobs")
        self._require_reference()
        return self._inference_pass(PolicyWorker.logprobs, batch, True)

    def get_topk_logits(self, batch: Batch, k: int) -> Batch:
        self._require_head("lm", "get_topk_logits")
        return self._inference_pass(PolicyWorker.topk, batch, k)

    def get_values(self, batch: Batch) -> Batch:
        self._require_head("value", "get_values")
        return self._inference_pass(PolicyWorker.values, batch)

    def logprobs_into(self, samples: PlaneSamples, field: str, *, reference: bool = False) -> None:
        self._require_head("lm", "logprobs")
        if samples.plane.worker_handle() is None:  # through get_(reference_policy_)logprobs, which check
            return super().logprobs_into(samples, field, reference=reference)
        if reference:
            self._require_reference()
        source = "reference_logprobs" if reference else "logprobs"
        routes = {ROUTES_FIELD: ROUTES_FIELD} if self.config.policy.moe.routing_replay == "previous" and not reference else {}
        self._pass_into(samples, self.config.policy.logprob_micro_batch_size, {field: source, **routes},
                        PolicyWorker.logprobs, reference)

    def values_into(self, samples: PlaneSamples, field: str) -> None:
        self._require_head("value", "get_values")
        if samples.plane.worker_handle() is None:
            return super().values_into(samples, field)
        self._pass_into(samples, self.config.policy.logprob_micro_batch_size, {field: "values"}, PolicyWorker.values)

    def topk_into(self, samples: PlaneSamples, k: int, fields: Mapping[str, str]) -> None:
        self._require_head("lm", "get_topk_logits")
        if samples.plane.worker_handle() is None:
            return super().topk_into(samples, k, fields)
        self._pass_into(samples, self.config.policy.logprob_micro_batch_size, dict(fields), PolicyWorker.topk, k)

    def map_into(self, samples: PlaneSamples, fn: SampleMap) -> dict[str, float]:
        handle = samples.plane.worker_handle()
        if handle is None:
            return super().map_into(samples, fn)
        n, keys = len(samples), samples.keys
        bounds = [n * d // self.dp_size for d in range(self.dp_size + 1)]
        shards = [ShardRef(handle, samples.partition, keys[bounds[d]:bounds[d + 1]], samples.fields)
                  for d in range(self.dp_size)]
        results = self.group.run_sharded(PolicyWorker.map_shard, shards, fn, self.result_ranks, shard_of_rank=self._dp_rank)
        return combine_metrics([results[r] or {} for r in self.result_ranks], {})

    def _pass_into(
        self, samples: PlaneSamples, micro_batch_size: int, fields: Mapping[str, str],
        method: Callable[..., Batch | None], *args: Any,
    ) -> None:
        """Run the inference pass ``method`` on ``samples``, each worker fetching its shard from
        the plane and writing the result fields ``fields`` ({plane field: result field}) back."""
        handle = samples.plane.worker_handle()
        assert handle is not None
        n = len(samples)
        if n == 0:
            raise ValueError(f"{method.__name__}: no samples")
        order = padded_order(n, self.dp_size)
        padded = attrs.evolve(samples, keys=[samples.keys[i] for i in order])
        lengths = self._lengths(samples)
        plan = self._plan([lengths[i] for i in order], micro_batch_size)

        def sink(dp_rank: int, shard: list[int]) -> ResultSink:
            rows = [j for j, i in enumerate(shard) if i < n]  # padding rows repeat a sample stored elsewhere
            return ResultSink(fields.items(), rows, writer_rank=self.result_ranks[dp_rank])

        self._run_pass(method, plan.work_by_reference(handle, padded, sink), *args)

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
        head, wanted = self.config.policy.head, loss_fn.input_type
        if (wanted == "values") != (head == "value"):
            raise ConfigError(f"the loss {type(loss_fn).__name__} takes {wanted}, which a policy with policy.head "
                              f"'{head}' does not give")
        if wanted not in self.group.worker_cls.loss_inputs:
            raise ConfigError(f"the loss {type(loss_fn).__name__} takes {wanted}, which the {self.config.policy.backend} "
                              f"backend does not compute; it computes {', '.join(self.group.worker_cls.loss_inputs)}")
        results: list[RankTrainResult]
        results, everyone = self._run_pass(PolicyWorker.train, work, loss_fn, eval_mode)
        metrics = agreement_metrics(combine_metrics([r["metrics"] for r in results], loss_fn.metric_reductions))
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
        self.group.run_all(PolicyWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.group.run_all(PolicyWorker.load_checkpoint, path)

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """The weights on the training device for the block (for gathers, which are
        collectives; the optimizer state stays off it where the backend can leave it),
        offloaded again after it if they were before."""
        if not self.offloaded:
            yield
            return
        self.group.run_all(PolicyWorker.onload_weights)
        try:
            yield
        finally:
            self.offload()

    def export_hf(self, path: str) -> None:
        with self._on_device():
            self.group.run_all(PolicyWorker.export_hf, path, HF_SHARD_BYTES)

    def export_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        with self._on_device():
            for names in bucket_names(self.group.run_rank0(PolicyWorker.weight_sizes), bucket_bytes):
                bucket = self.group.run_all(PolicyWorker.gather_weights, names)[0]
                assert bucket is not None, "rank 0 gathers the full weights"
                yield bucket

    def send_weights(self, endpoint: WeightEndpoint, bucket_bytes: int, version: int) -> RefitStats:
        with self._on_device():
            return self._send_weights(endpoint, bucket_bytes, version)

    def _send_weights(self, endpoint: WeightEndpoint, bucket_bytes: int, version: int) -> RefitStats:
        if self._weight_endpoint != (endpoint, bucket_bytes):
            self.group.run_all(PolicyWorker.connect_weights, endpoint, bucket_bytes)
            self._weight_endpoint = (endpoint, bucket_bytes)
        try:
            stats = self.group.run_all(PolicyWorker.send_weights, version)[0]
        except BaseException:
            self._weight_endpoint = None  # the sync group may be broken: reconnect next time
            raise
        assert stats is not None, "rank 0 sends the weights"
        return stats.refit_stats()

    def host_engines(self, engine_cls: type, kwargs: Mapping[str, Any], name: str) -> HostedGroup:
        return HostedGroup(self.group, name, engine_cls, kwargs)

    def prepare_for_training(self) -> None:
        self.group.run_all(PolicyWorker.prepare_for_training)
        self.offloaded = False

    def offload(self) -> None:
        self.group.run_all(PolicyWorker.offload)
        self.offloaded = True

    def info(self) -> dict[str, Any]:
        return self.group.run_rank0(PolicyWorker.info)

    def shutdown(self) -> None:
        self.group.shutdown()
