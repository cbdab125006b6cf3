"""The driver side of the dtensor policy: plans each pass and talks to the worker group.

Rank ``r`` of the group is data-parallel rank ``r // tp`` and tensor-parallel rank
``r % tp`` (the mesh is ``(dp, tp)`` in row-major order). Each pass shards the batch over
the data-parallel ranks (length-balanced when packing or dynamic batching is on, contiguous
otherwise), sends the same shard to the tensor-parallel ranks of a replica, and puts the
results back in the batch's order. The batching fields of ``config.policy`` (micro batch
sizes, ``sequence_packing``, ``dynamic_batching``) are read at every pass and travel with
the work, so the workers follow whatever the driver planned.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from posttrain.batch import Batch
from posttrain.config.schema import RunConfig
from posttrain.config.validate import validate_config
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain.interfaces.loss import LossFunction, combine_metrics
from posttrain.interfaces.policy import Policy
from posttrain_dtensor.checkpoint import bucket_names
from posttrain_dtensor.config import SECTION, DTensorConfig
from posttrain_dtensor.planning import Batching, PassPlan, plan_pass
from posttrain_dtensor.worker import DTensorPolicyWorker

#: Largest safetensors shard :meth:`DTensorPolicy.export_hf` writes.
HF_SHARD_BYTES = 4 * 1024**3


class DTensorPolicy(Policy):
    """A :class:`~posttrain.interfaces.Policy` trained with FSDP2 / tensor parallel."""

    def __init__(self, config: RunConfig, cluster: VirtualCluster, *, name: str = "policy"):
        validate_config(config)  # what a run checks, for policies built directly from a RunConfig
        self.config = config
        options = config.sections.get(SECTION) or DTensorConfig()
        p = config.policy
        self.dp_size = p.data_parallel_size
        self.tp_size = p.tensor_parallel_size
        self.group = WorkerGroup(
            cluster, DTensorPolicyWorker, name=name, num_workers=p.num_workers, resources=p.resources,
            args=(config, options),
        )

    # ------------------------------------------------------------------ planning

    def _batching(self, micro_batch_size: int) -> Batching:
        p = self.config.policy
        if p.sequence_packing.enabled:
            per_row = p.sequence_packing.max_tokens_per_row or p.max_total_sequence_length
            return Batching(micro_batch_size, packing_tokens_per_row=per_row, round_to=p.sequence_packing.round_to)
        if p.dynamic_batching.enabled:
            return Batching(micro_batch_size, dynamic_max_tokens=p.dynamic_batching.max_tokens_per_microbatch,
                            round_to=p.dynamic_batching.round_to)
        return Batching(micro_batch_size)

    def _run_pass(
        self, method: str, batch: Batch, micro_batch_size: int, *args: Any, row_group_size: int = 1
    ) -> tuple[list[Any], PassPlan]:
        plan = plan_pass(batch["input_lengths"].tolist(), self.dp_size, self._batching(micro_batch_size), row_group_size)
        results = self.group.run_sharded(method, plan.work(batch), *args, shard_of_rank=lambda rank: rank // self.tp_size)
        # Tensor-parallel ranks of a replica return the same result: keep tp rank 0's.
        return results[:: self.tp_size], plan

    def _inference_pass(self, method: str, batch: Batch, *args: Any) -> Batch:
        n = len(batch)
        if n == 0:
            raise ValueError(f"{method}: the batch is empty")
        padded = batch.select(list(range(n)) + [n - 1] * (-n % self.dp_size))
        outputs, plan = self._run_pass(method, padded, self.config.policy.logprob_micro_batch_size, *args)
        return Batch.restore_order(outputs, plan.shards).slice(0, n)

    # ------------------------------------------------------------------ Policy

    def get_logprobs(self, batch: Batch) -> Batch:
        return self._inference_pass("logprobs", batch, False)

    def get_reference_policy_logprobs(self, batch: Batch) -> Batch:
        return self._inference_pass("logprobs", batch, True)

    def get_topk_logits(self, batch: Batch, k: int) -> Batch:
        return self._inference_pass("topk", batch, k)

    def train(self, batch: Batch, loss_fn: LossFunction, *, eval_mode: bool = False) -> dict[str, float]:
        results, _ = self._run_pass("train", batch, self.config.policy.train_micro_batch_size, loss_fn, eval_mode,
                                    row_group_size=loss_fn.row_group_size)
        metrics = combine_metrics([r["metrics"] for r in results], loss_fn.metric_reductions)
        metrics.update(
            loss=sum(r["loss"] for r in results),
            lr=results[0]["lr"],
            num_tokens=results[0]["num_tokens"],
            step_time_s=max(r["step_time_s"] for r in results),
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
