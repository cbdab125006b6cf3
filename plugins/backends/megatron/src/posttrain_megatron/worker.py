"""One rank of the megatron policy: its pipeline stage and tensor-parallel slices of a
megatron-core ``GPTModel``, wrapped in megatron-core's ``DistributedDataParallel``, and its
optimizer (megatron-core's, optionally the distributed one).

The rank forms its process group from the worker group's environment (NCCL on a GPU,
gloo without CUDA), initialises megatron-core's parallel state (tensor, pipeline, context
and data parallel groups), converts the Hugging Face weights of ``policy.model`` one tensor
at a time and keeps this rank's slices of them on CPU as the frozen reference. Without
CUDA, every call into megatron-core runs under :mod:`posttrain_megatron.cpu_compat`.

Passes: every rank of a data-parallel replica receives the replica's
:class:`~posttrain.backend.work.RankWork`; the ranks holding tensor-parallel rank 0 and
context-parallel rank 0 of the last pipeline stage return the results, the others None
(``train`` returns only ``step_time_s`` there).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from posttrain.backend.hf_export import write_hf_metadata, write_hf_shards
from posttrain.backend.lr_schedule import check_scheduler_config, lr_factor
from posttrain.backend.policy_worker import PolicyWorker, require_policy_checkpoint
from posttrain.backend.routing import NO_ROUTE, ROUTES_FIELD
from posttrain.backend.sampling import logprob_temperature
from posttrain.backend.weight_sync import ParamMeta
from posttrain.backend.work import RankWork
from posttrain.batch import Batch
from posttrain.config.schema import RunConfig
from posttrain.distributed.placement import uses_cuda
from posttrain.errors import ConfigError
from posttrain.interfaces.loss import LossFunction, combine_metrics, global_valid_counts
from posttrain.models.folder import read_model_config
from posttrain_megatron import adam_fallback, cpu_compat, te_fallback
from posttrain_megatron.config import MegatronConfig
from posttrain_megatron.convert import Architecture, expert_of, exported_names, hf_shapes, to_hf, tp_merge
from posttrain_megatron.head import make_rows, row_multiple, sample_logprobs, sample_topk
from posttrain_megatron.model import (
    build_model,
    fused_norms,
    load_hf_weights,
    named_parameters,
    output_weight,
    transformer_config,
)
from posttrain_megatron.routes import MegatronRouters, lay_out
from posttrain_megatron.schedule import Microbatch, finalize_grads, run_microbatches

TRAINER_STATE = "trainer_state.pt"
MEGATRON_STATE = "megatron"  # the megatron-core distributed checkpoint under the step folder
#: How megatron-core's distributed optimizer writes its state: as whole per-parameter tensors
#: (readable under another parallel layout; its default format is no longer loadable).
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


class MegatronPolicyWorker(PolicyWorker):
    """One rank. Public methods are called by the driver through the worker group; passes,
    checkpoints and weight gathering are collectives: every rank is called."""

    def __init__(self, config: RunConfig, options: MegatronConfig, reference: bool = True):
        super().__init__()
        cpu_compat.apply()
        adam_fallback.apply()
        te_fallback.apply()
        with cpu_compat.cuda_as_cpu():
            self._setup(config, options, reference)

    def _setup(self, config: RunConfig, options: MegatronConfig, reference: bool) -> None:
        from transformers import AutoConfig

        policy = config.policy
        self.config, self.options = config, options
        self.device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda() else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=policy.tensor_parallel_size,
            pipeline_model_parallel_size=options.pipeline_parallel_size,
            context_parallel_size=options.context_parallel_size,
            expert_model_parallel_size=policy.moe.expert_parallel_size,
        )
        cpu_compat.seed_rng(config.seed)
        read_model_config(policy.model, "policy.model")  # a clear error before transformers' own
        self.arch = Architecture.from_hf_config(AutoConfig.from_pretrained(policy.model))
        check_scheduler_config(policy.scheduler)
        self.fused_norms = fused_norms(options)
        self.compute_dtype = getattr(torch, policy.dtype)
        self.temperature = logprob_temperature(config.generation.temperature)
        self.row_multiple = row_multiple(policy.tensor_parallel_size, options.context_parallel_size,
                                         options.sequence_parallel)

        tcfg = transformer_config(self.arch, policy, options, on_gpu=self.device.type == "cuda")
        tcfg.finalize_model_grads_func = finalize_grads
        self.model = build_model(self.arch, tcfg, options).to(self.device)
        load_hf_weights(self.model, self.arch, policy.model, fused=self.fused_norms)
        #: policy.moe: the routers, given the rollout's experts (routing_replay: rollout, router_agreement)
        #: or their own of the previous-logprob pass (routing_replay: previous, which the logprob pass returns)
        moe = policy.moe
        self.routers = (MegatronRouters(self.model, self.arch.moe_layers, apply=moe.routing_replay != "off")
                        if tcfg.moe_enable_routing_replay else None)
        self.returns_routes = self.routers is not None and moe.routing_replay == "previous"
        self.ddp = DistributedDataParallel(
            tcfg,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=options.grad_reduce_in_fp32,
                use_distributed_optimizer=options.distributed_optimizer,
            ),
            self.model,
        )
        opt = policy.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="sgd" if opt.name == "sgd" else "adam",
                decoupled_weight_decay=opt.name == "adamw",
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                adam_eps=opt.eps,
                sgd_momentum=0.0,
                # megatron-core computes the gradient norm only when it clips: inf clips nothing
                clip_grad=policy.max_grad_norm or float("inf"),
                params_dtype=self.compute_dtype,
                bf16=self.compute_dtype == torch.bfloat16,
                use_distributed_optimizer=options.distributed_optimizer,
            ),
            [self.ddp],
            # {}: weight decay on every parameter; None: megatron's exemption of norms and biases
            config_overrides={} if options.weight_decay_norms_and_biases else None,
        )
        adam_fallback.create_state(self.optimizer)
        self.step = 0
        # The frozen reference: this rank's slices of the initial weights, on CPU (none when
        # the run asks for no reference logprobs).
        self._reference = {
            name: p.detach().to("cpu", copy=True) for name, p in named_parameters(self.model)
        } if reference else {}
        self.holds_results = (
            parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
        )

    # ------------------------------------------------------------------ layout

    @cpu_compat.cuda_as_cpu_method
    def coordinates(self) -> dict[str, int]:
        """This rank's data, tensor, pipeline and context parallel ranks, and whether it
        returns pass results."""
        return {
            "dp": parallel_state.get_data_parallel_rank(),
            "tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank(),
            "holds_results": self.holds_results,
        }

    # ------------------------------------------------------------------ passes

    def _microbatches(self, work: RankWork) -> list[Microbatch]:
        if work.batching.packing_tokens_per_row is not None:
            raise ConfigError("policy.sequence_packing is not implemented by the megatron backend")
        cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        tp_part = ((parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
                   if self.options.sequence_parallel else None)
        out = []
        for idx in work.microbatches:
            mb = work.batch.select(idx)
            rows = make_rows(mb["input_ids"], mb["input_lengths"], self.row_multiple, cp, cp_rank)
            routes = None
            if self.routers is not None and ROUTES_FIELD in mb:
                routes = lay_out(mb[ROUTES_FIELD], mb["input_lengths"], rows, tp_part).to(self.device)
            out.append(Microbatch(mb, rows.to(self.device), routes))
        return out

    def _give_routes(self, mb: Microbatch) -> None:
        if self.routers is not None:
            self.routers.set(mb.routes)

    def _run(self, microbatches: list[Microbatch], stage, *, forward_only: bool) -> list[dict[str, Any]]:
        return run_microbatches(self.ddp, microbatches, stage, forward_only=forward_only, before_forward=self._give_routes)

    def _chosen_routes(self, mb: Microbatch) -> torch.Tensor:
        """The experts the routers chose in the forward just run on ``mb``, per sample: int16
        [b, S, layers, k], :data:`NO_ROUTE` past each sample's length (one pipeline stage, no
        context or sequence parallelism: the configuration checks refuse the others)."""
        taken = self.routers.take()  # [width x b, layers, k], position-major
        b, width = mb.rows.input_ids.shape
        chosen = taken.view(width, b, *taken.shape[1:]).transpose(0, 1)
        samples = mb.batch["input_ids"].shape[1]
        out = torch.full((b, samples, *taken.shape[1:]), NO_ROUTE, dtype=taken.dtype)
        n = min(samples, width)
        out[:, :n] = chosen[:, :n]
        real = torch.arange(samples)[None, :] < mb.batch["input_lengths"][:, None]
        return torch.where(real[..., None, None], out, NO_ROUTE)

    def _logprobs_of(self, hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        return sample_logprobs(
            hidden, output_weight(self.model), mb.rows, mb.batch,
            vocab_size=self.arch.vocab_size, chunk_size=self.config.policy.logprob_chunk_size,
            temperature=self.temperature, sequence_parallel=self.options.sequence_parallel,
        )

    @cpu_compat.cuda_as_cpu_method
    def logprobs(self, work: RankWork, reference: bool = False) -> Batch | None:
        """``logprobs`` [n, S] of this replica's samples (current or reference weights); with
        ``policy.moe.routing_replay: previous`` (current weights) also ``routed_experts`` [n, S,
        layers, k], the experts its routers chose, for the training passes to replay."""
        routes = self.returns_routes and not reference

        def stage(hidden: torch.Tensor, mb: Microbatch):
            report = {"logprobs": self._logprobs_of(hidden, mb).float().cpu()}
            if routes:
                report[ROUTES_FIELD] = self._chosen_routes(mb)
            return hidden.new_zeros(()), report

        self.ddp.eval()
        if routes:
            self.routers.record = True
        try:
            with self._reference_weights() if reference else contextlib.nullcontext(), torch.no_grad():
                reports = self._run(self._microbatches(work), stage, forward_only=True)
        finally:
            if self.routers is not None:
                self.routers.record = False
                self.routers.agreement.counts()  # the training pass reports the agreement, not this one
        if not self.holds_results:
            return None
        shape = work.batch["input_ids"].shape
        name = "reference_logprobs" if reference else "logprobs"
        out = {name: torch.zeros(shape, dtype=torch.float32)}
        if routes:
            layers, k = sum(self.arch.moe_layers), self.arch.experts_per_token
            out[ROUTES_FIELD] = torch.full((*shape, layers, k), NO_ROUTE, dtype=reports[0][ROUTES_FIELD].dtype)
        for idx, report in zip(work.microbatches, reports, strict=True):
            out[name][idx] = report["logprobs"]
            if routes:
                out[ROUTES_FIELD][idx] = report[ROUTES_FIELD]
        return Batch(out)

    @cpu_compat.cuda_as_cpu_method
    def topk(self, work: RankWork, k: int) -> Batch | None:
        """``topk_logits`` and ``topk_indices`` [n, S-1, k] (raw logits; 0 on padding)."""
        n, width = work.batch["input_ids"].shape

        def stage(hidden: torch.Tensor, mb: Microbatch):
            vals, ids = sample_topk(
                hidden, output_weight(self.model), mb.rows, mb.batch["input_lengths"], k, width,
                vocab_size=self.arch.vocab_size, chunk_size=self.config.policy.logprob_chunk_size,
                sequence_parallel=self.options.sequence_parallel,
            )
            return hidden.new_zeros(()), {"values": vals.cpu(), "indices": ids.cpu()}

        self.ddp.eval()
        with torch.no_grad():
            reports = self._run(self._microbatches(work), stage, forward_only=True)
        if self.routers is not None:
            self.routers.agreement.counts()  # the training pass reports the agreement, not this one
        if not self.holds_results:
            return None
        values = torch.zeros((n, width - 1, k), dtype=torch.float32)
        indices = torch.zeros((n, width - 1, k), dtype=torch.long)
        for idx, report in zip(work.microbatches, reports, strict=True):
            values[idx], indices[idx] = report["values"], report["indices"]
        return Batch({"topk_logits": values, "topk_indices": indices})

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """Swap the reference weights into the model in place, and the current ones back after."""
        params = dict(named_parameters(self.model))
        with torch.no_grad():
            current = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
            for name, p in params.items():
                p.copy_(self._reference[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(current[name])

    # ------------------------------------------------------------------ training

    @cpu_compat.cuda_as_cpu_method
    def train(self, work: RankWork, loss_fn: LossFunction, eval_mode: bool = False) -> dict[str, Any]:
        """Forward/backward over this replica's microbatches, then (unless ``eval_mode``) one
        optimizer step (gradients clipped to ``policy.max_grad_norm``). Returns this
        replica's shares of the loss and loss metrics and the step's ``grad_norm``, ``lr``,
        ``num_tokens``, ``step_time_s`` (only ``step_time_s`` on ranks not holding results)."""
        start = time.perf_counter()
        seqs, toks = global_valid_counts(work.batch, parallel_state.get_data_parallel_group_gloo())
        seqs_dev, toks_dev = seqs.to(self.device), toks.to(self.device)

        def stage(hidden: torch.Tensor, mb: Microbatch):
            loss, metrics = loss_fn(self._logprobs_of(hidden, mb), mb.batch.to(self.device), seqs_dev, toks_dev)
            return loss, {"loss": float(loss.detach()), "metrics": metrics}

        lr = self._set_lr()
        self.ddp.train(not eval_mode)
        if not eval_mode:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        with torch.no_grad() if eval_mode else contextlib.nullcontext():
            reports = self._run(self._microbatches(work), stage, forward_only=eval_mode)
        parts = [r["metrics"] for r in reports]
        if self.routers is not None:  # counts of tokens: summed over ranks, then fractions (agreement_metrics)
            parts.append(self.routers.agreement_counts(self._routing_groups(), self.device))
        result: dict[str, Any] = {}
        if not eval_mode:
            result["grad_norm"] = self._optimizer_step()
        if self.holds_results:
            result.update(
                loss=sum(r["loss"] for r in reports),
                metrics=combine_metrics(parts, loss_fn.metric_reductions),
                num_tokens=float(toks),
                lr=lr,
            )
        result["step_time_s"] = time.perf_counter() - start
        return result

    def _routing_groups(self) -> list[dist.ProcessGroup]:
        """The ranks whose routers see other tokens or layers of this replica's forwards."""
        groups = []
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            groups.append(parallel_state.get_pipeline_model_parallel_group())
        if self.options.sequence_parallel:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        return groups

    def _set_lr(self) -> float:
        """Set this step's learning rate from ``policy.scheduler``; return it."""
        policy = self.config.policy
        lr = policy.optimizer.lr * lr_factor(self.step, policy.scheduler)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _optimizer_step(self) -> float:
        """One step; the gradient norm before clipping (over all model-parallel ranks)."""
        _, grad_norm, _ = self.optimizer.step()
        self.step += 1
        return float(grad_norm)

    # ------------------------------------------------------------------ checkpoints

    @cpu_compat.cuda_as_cpu_method
    def save_checkpoint(self, path: str) -> None:
        """Collective: one megatron-core distributed checkpoint of the model and optimizer
        (loadable under another parallel layout) and, from rank 0, the step."""
        folder = Path(path)
        (folder / MEGATRON_STATE).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(folder / MEGATRON_STATE))
        if dist.get_rank() == 0:
            torch.save({"step": self.step}, folder / TRAINER_STATE)
        dist.barrier()

    @cpu_compat.cuda_as_cpu_method
    def load_checkpoint(self, path: str) -> None:
        folder = require_policy_checkpoint(path, (MEGATRON_STATE, TRAINER_STATE), "megatron")
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(folder / MEGATRON_STATE))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        adam_fallback.unshare_steps(self.optimizer)
        self.step = torch.load(folder / TRAINER_STATE, weights_only=False)["step"]

    def _sharded_state(self, *, is_loading: bool) -> dict[str, Any]:
        model = self.model.sharded_state_dict()
        # is_loading creates Adam's state to load into; megatron-core has no state initialiser for SGD
        optimizer = self.optimizer.sharded_state_dict(
            model, is_loading=is_loading and self.config.policy.optimizer.name != "sgd", metadata=OPTIMIZER_FORMAT
        )
        return {"model": model, "optimizer": optimizer}

    # ------------------------------------------------------------------ weights

    def weight_metadata(self) -> list[ParamMeta]:
        """Every exported tensor: HF name, full shape, ``policy.dtype``, in export order."""
        dtype = str(self.compute_dtype).removeprefix("torch.")
        return [ParamMeta(name, tuple(shape), dtype) for name, shape in hf_shapes(self.arch).items()]

    @cpu_compat.cuda_as_cpu_method
    @torch.no_grad()
    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Collective: the named whole tensors under Hugging Face names, on rank 0 (CPU,
        ``policy.dtype``); None elsewhere. Tensor-parallel slices are gathered within the
        first data-parallel replica, a layer's experts over its expert-parallel group (whose
        ranks are the first data-parallel ranks), pipeline stages send theirs to rank 0."""
        wanted = set(names)
        mine: dict[str, torch.Tensor] = {}
        dense_holder = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0
        expert_holder = parallel_state.get_expert_data_parallel_rank() == 0
        if not (dense_holder or expert_holder):
            return None
        experts: dict[str, list[torch.Tensor]] = {}  # stacked name -> this rank's experts so far
        local_experts = self.arch.num_experts // parallel_state.get_expert_model_parallel_world_size()
        for name, param in named_parameters(self.model):
            expert = expert_of(name)
            whole_name = name if expert is None else expert[0]
            if not (dense_holder if expert is None else expert_holder):
                continue
            if not wanted & set(exported_names(self.arch, whole_name, fused_norms=self.fused_norms)):
                continue
            group = (parallel_state.get_tensor_model_parallel_group() if expert is None
                     else parallel_state.get_expert_tensor_parallel_group())
            pieces = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, param.detach().contiguous(), group=group)
            whole = tp_merge(name, pieces)
            if expert is not None:  # the layer's experts, once this rank has all of its own
                experts.setdefault(whole_name, []).append(whole)
                if len(experts[whole_name]) < local_experts:
                    continue
                whole = self._gather_experts(torch.stack(experts.pop(whole_name)))
            for hf_name, tensor in to_hf(self.arch, whole_name, whole, fused_norms=self.fused_norms).items():
                if hf_name in wanted:
                    mine[hf_name] = tensor.to("cpu", self.compute_dtype, copy=True)
        if not dense_holder:
            return None
        if parallel_state.get_pipeline_model_parallel_world_size() > 1 and parallel_state.get_tensor_model_parallel_rank() == 0:
            stages = [None] * parallel_state.get_pipeline_model_parallel_world_size() if self.rank == 0 else None
            dist.gather_object(mine, stages, dst=0, group=parallel_state.get_pipeline_model_parallel_group())
            mine = {k: v for stage in stages for k, v in stage.items()} if self.rank == 0 else mine
        return mine if self.rank == 0 else None

    @staticmethod
    def _gather_experts(local: torch.Tensor) -> torch.Tensor:
        """Every expert of a layer [E, ...] from each expert-parallel rank's [E / ep, ...]."""
        group = parallel_state.get_expert_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    def export_hf(self, path: str, shard_bytes: int) -> None:
        """Collective: a Hugging Face folder at ``path`` (written by rank 0)."""
        if write_hf_shards(path, self.weight_sizes(), self.gather_weights, shard_bytes, writer=self.rank == 0):
            self._write_hf_metadata(path)
        dist.barrier()

    def _write_hf_metadata(self, path: str) -> None:
        from transformers import AutoConfig, GenerationConfig

        policy = self.config.policy
        generation = (
            GenerationConfig.from_pretrained(policy.model)
            if Path(policy.model, "generation_config.json").is_file() else None
        )
        write_hf_metadata(path, AutoConfig.from_pretrained(policy.model), policy.tokenizer or policy.model,
                          self.compute_dtype, generation, model_source=policy.model)

    # ------------------------------------------------------------------ placement

    def offload(self) -> None:
        """Move weights, gradients and optimizer state to CPU memory (no-op on CPU); the
        float32 master weights of bfloat16 training stay on the GPU."""
        if self.device.type == "cpu":
            return
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        self._move_optimizer_state(torch.device("cpu"))
        torch.cuda.empty_cache()

    def prepare_for_training(self) -> None:
        """Bring weights, gradients and optimizer state back to the GPU (no-op on CPU)."""
        if self.device.type == "cpu":
            return
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            buffer.reload_from_cpu(move_params=True, move_grads=True)
        self._move_optimizer_state(self.device)
        torch.cuda.synchronize()

    def _move_optimizer_state(self, device: torch.device) -> None:
        """Optimizer state tensors (Adam's moments). The float32 master weights of a
        mixed-precision or distributed optimizer stay where they are: some are views of the
        model's parameter buffers, which moving would break."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for state in opt.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        state[key] = value.to(device, non_blocking=True)

    def info(self) -> dict[str, Any]:
        return {
            "backend": "megatron",
            "parameters": sum(torch.Size(s).numel() for s in hf_shapes(self.arch).values()),
            "world_size": self.world_size,
            "data_parallel_size": parallel_state.get_data_parallel_world_size(),
            "tensor_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": parallel_state.get_context_parallel_world_size(),
            "expert_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
            "sequence_parallel": self.options.sequence_parallel,
            "distributed_optimizer": self.options.distributed_optimizer,
            "device": str(self.device),
            "dtype": str(self.compute_dtype).removeprefix("torch."),
            "pid": os.getpid(),
        }
