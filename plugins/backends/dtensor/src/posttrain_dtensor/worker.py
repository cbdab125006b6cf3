"""One rank of the dtensor policy: its shard of the model, optimizer and schedule.

Why plain torch and transformers rather than nemo-automodel: the sharding this backend
needs is a few calls of public torch API (``init_device_mesh``, ``parallelize_module``
with the model's own Hugging Face tensor-parallel plan, ``fully_shard``), which work on
CPU with gloo and on GPU with NCCL alike. nemo-automodel 0.7's model builders call
``torch.cuda.current_device()`` unconditionally (they fail on CPU, where posttrain's tests
run), default to bfloat16, and leave logits vocabulary-sharded anyway, so the loss and
the chunked logprob head are ours either way; depending on it would add a large install
and a CPU workaround for no code removed.

The rank builds its process group from the worker group's environment (gloo on CPU, NCCL on
GPU), loads the Hugging Face model from ``policy.model`` in float32 (the master weights),
shards it (:mod:`posttrain_dtensor.parallel`) and computes in ``policy.dtype`` through
FSDP2 mixed precision; a single float32 rank keeps the plain module. The driver
(:mod:`posttrain_dtensor.policy`) sends each data-parallel rank its shard of the batch and
its microbatch plan; tensor-parallel ranks of one replica receive the same shard. Logprobs,
in every pass and in training, are those of ``logits / T`` with ``T`` from
``generation.temperature`` (read when the rank starts; see
:func:`posttrain.backend.sampling.logprob_temperature`); top-k logits are raw.

With ``policy.lora`` (:mod:`posttrain_dtensor.lora`), peft's adapters are injected before the
model is sharded; only they reach the optimizer, its state and checkpoints; the reference
pass turns them off; the weight sync sends the merged weights (or, with
``policy.lora.refit: adapter``, the adapters) and the export writes a PEFT folder
(:mod:`posttrain_dtensor.weights`).

With ``generation.exact_logprobs``, logprobs (every pass, and training's) are computed from
each turn's scoring prefix (:func:`posttrain_dtensor.rows.exact_rows`, the layout of
:mod:`posttrain.backend.exact`) with attention that runs every prefix at exactly its length,
experts that run token by token, and LoRA layers compute with their merged weight (:func:`posttrain_dtensor.lora.compute_merged`),
so a generation engine reports the same bits.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.backend.adapter_folder import MERGED_FOLDER, write_adapter_folder
from posttrain.backend.exact import EXPERTS_IMPLEMENTATION, MIN_ROWS
from posttrain.backend.hf_export import write_hf_metadata, write_hf_shards
from posttrain.backend.hf_layout import checkpoint_tensors
from posttrain.backend.logprobs import logsumexp_logits, loss_positions, sequence_logprobs, topk_logits
from posttrain.backend.lr_schedule import build_scheduler
from posttrain.backend.policy_worker import PolicyWorker, RankTrainResult
from posttrain.backend.router_losses import (
    AUX_LOSS_METRIC,
    EXPERT_LOAD_METRIC,
    Z_LOSS_METRIC,
    RouterLogits,
    expert_assignments,
    expert_loads,
    load_balancing_loss,
    z_loss,
)
from posttrain.backend.routing import NO_ROUTE, ROUTES_DTYPE, ROUTES_FIELD, Routers, find_routers
from posttrain.backend.sampling import logprob_temperature
from posttrain.backend.weight_sync import ParamMeta
from posttrain.backend.work import Batching, RankWork
from posttrain.batch import Batch
from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.distributed.placement import uses_cuda
from posttrain.errors import ConfigError
from posttrain.interfaces.loss import LossFunction, combine_metrics, global_valid_counts
from posttrain.models.folder import read_model_config
from posttrain_dtensor import checkpoint
from posttrain_dtensor.config import DTensorConfig
from posttrain_dtensor.experts import split_experts
from posttrain_dtensor.lora import ADAPTER, adapters_disabled, attach_adapters, compute_merged
from posttrain_dtensor.optim import build_optimizer, clip_grads_, total_grad_norm
from posttrain_dtensor.parallel import (
    CausalLMHead,
    apply_fsdp,
    apply_tensor_parallel,
    build_meshes,
    load_from_rank0,
    output_softcap,
    reshard_all,
    split_decoder,
    sum_gradients,
)
from posttrain_dtensor.rows import ModelRows, exact_rows, microbatch_rows
from posttrain_dtensor.segment_attention import EXACT_SEGMENT_SDPA, SEGMENT_SDPA
from posttrain_dtensor.tied_gradient import tie_gradients
from posttrain_dtensor.vision import image_model_inputs
from posttrain_dtensor.weights import AdapterWeights, FullWeights, MergedWeights, WeightView


def trained_model(policy: PolicyConfig, model_config: Any, load: dict[str, Any], *, weights: bool) -> torch.nn.Module:
    """``policy.model`` as the policy trains it, loaded with ``load``: its causal LM (or
    vision-language model), or for a value head a one-label sequence classifier (its score
    layer new, drawn from the seeded RNG). ``weights`` False: built from ``model_config``
    alone (under the meta device: :func:`~posttrain_dtensor.parallel.load_from_rank0` fills it)."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.auto import generative_class

    if policy.head == "value":
        if weights:
            lm = AutoModelForSequenceClassification.from_pretrained(policy.model, num_labels=1, **load)
        else:
            one_label = copy.deepcopy(model_config)
            one_label.num_labels = 1
            lm = AutoModelForSequenceClassification.from_config(one_label, **load)
        lm.config.architectures = [type(lm).__name__]  # what the exported folder loads as
        return lm
    model_class = generative_class(model_config)
    return model_class.from_pretrained(policy.model, **load) if weights else model_class.from_config(model_config, **load)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (names checked by ``validate_policy_config``)."""
    return getattr(torch, name)


def _metadata(view: WeightView, dtype: torch.dtype) -> list[ParamMeta]:
    """``view``'s tensors as sent: name, full (global) shape and ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    return [ParamMeta(key, tuple(t.shape), name) for key, t in view.named()]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a (possibly sharded) parameter, aliasing its storage."""
    return param.to_local() if isinstance(param, DTensor) else param


class DTensorPolicyWorker(PolicyWorker):
    """One rank. Public methods are called by the driver through the worker group; the
    passes taking a :class:`RankWork` run collectives: every rank gets one with the same
    number of microbatches. With ``policy.head: value`` the model is the folder's
    ``AutoModelForSequenceClassification`` with one label (its ``score`` layer new, seeded by
    ``seed``, when the folder holds a causal LM), and training passes values to the loss."""

    loss_inputs = ("logprobs", "topk_logprobs", "values")

    def __init__(self, config: RunConfig, options: DTensorConfig, reference: bool = True):
        super().__init__()
        policy = config.policy
        self.config = config
        self.options = options
        use_cuda = config.cluster.use_gpus and uses_cuda()  # the worker was given a GPU (raises if torch sees none)
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo")
        tp = policy.tensor_parallel_size  # the driver checked that it divides the world size
        self.meshes = build_meshes(self.device.type, self.world_size // tp, tp, policy.moe.expert_parallel_size)
        self.dp_group = self.meshes.dp.get_group()
        self.compute_dtype = torch_dtype(policy.dtype)
        # logprobs (and the training loss's) are those of logits / T, as the sampler reports them
        self.temperature = logprob_temperature(config.generation.temperature)
        #: generation.exact_logprobs: logprobs laid out as the engines score them (posttrain.backend.exact)
        self.exact = config.generation.exact_logprobs
        #: With LoRA: the adapted layers' module paths (in the Hugging Face model) and scales.
        self.adapter_scales: dict[str, float] = {}
        #: Modules whose gradients are summed over the tensor-parallel ranks after backward.
        self.tp_summed: list[torch.nn.Module] = []
        self.model = self._build_model(config, options)
        #: policy.moe: the routers, given experts in the passes that follow: the rollout's (routing_replay:
        #: rollout, router_agreement) or their own of the previous-logprob pass (routing_replay: previous)
        self.routers = Routers(self.model.lm) if policy.moe.routes_key is not None else None
        self.replay_routes = policy.moe.routing_replay != "off"
        #: routing_replay: previous: the logprob pass (not the reference's) returns the experts its routers chose
        self.returns_routes = policy.moe.routing_replay == "previous"
        #: A mixture of experts: its routers' logits in training, for policy.moe's losses and moe/expert_load.
        routers = find_routers(self.model.lm)
        if policy.moe.router_losses and not routers:
            raise ConfigError(
                f"{policy.moe.router_losses_key}: {type(self.model.lm).__name__} has no router whose losses the dtensor "
                "backend computes (a module named *TopKRouter that picks experts with one topk, as Qwen3-MoE's and "
                f"Mixtral's do); set {policy.moe.router_losses_key}: 0 for this model"
            )
        self.router_logits = RouterLogits(routers) if routers else None
        #: The soft-cap of the model's logits (Gemma 2's final_logit_softcapping), applied by the chunked head.
        self.logit_softcap = output_softcap(self.model.lm)
        #: What the optimizer steps: every parameter, or the adapters alone under LoRA.
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.trained, policy.optimizer, self.model.lm)
        self.scheduler = build_scheduler(self.optimizer, policy.scheduler)
        self.step = 0
        self.offloaded = False  # offload() moved the state to CPU memory; prepare_for_training() brings it back
        self.optimizer_offloaded = False  # the optimizer state alone is in CPU memory after onload_weights()
        # The frozen reference: the base model with its adapters off under LoRA; otherwise
        # this rank's shards of the initial weights, on CPU (none when the run asks for no
        # reference logprobs: ``reference`` False).
        self._reference = {} if self.adapter_scales or not reference else {
            name: _local(p).detach().to("cpu", self.compute_dtype, copy=True) for name, p in self.model.named_parameters()
        }
        self.synced = self._synced_view()

    def _synced_view(self) -> WeightView:
        """What a weight sync sends: the full weights; under LoRA the merged weights, or the
        adapters alone with ``policy.lora.refit: adapter``."""
        lm = self.model.lm
        if not self.adapter_scales:
            return FullWeights(lm)
        if self.config.policy.lora.refit == "adapter":
            return AdapterWeights(lm, self.adapter_scales)
        return MergedWeights(lm, self.adapter_scales)

    def _build_model(self, config: RunConfig, options: DTensorConfig) -> torch.nn.Module:
        from transformers import AutoConfig

        from posttrain.models.auto import attention_implementation, vision_tower

        policy = config.policy
        read_model_config(policy.model, "policy.model")  # a clear error before transformers' own
        torch.manual_seed(config.seed)
        if config.deterministic:
            torch.use_deterministic_algorithms(True)
        # sdpa runs as segment attention: packed rows need bounds, not an O(width^2) mask
        segments = EXACT_SEGMENT_SDPA if self.exact else SEGMENT_SDPA
        kernel = segments if options.attn_implementation == "sdpa" else options.attn_implementation
        model_config = AutoConfig.from_pretrained(policy.model)
        kernel = attention_implementation(model_config, kernel, options.attn_implementation)
        load = dict(dtype=torch.float32, attn_implementation=kernel,
                    **({"experts_implementation": EXPERTS_IMPLEMENTATION} if self.exact else {}))
        # With several ranks only rank 0 reads the checkpoint; the others build the model on the meta
        # device and receive their shards once it is laid out (load_from_rank0): one copy of the whole
        # model in host memory, not one per rank.
        from_rank0 = self.world_size > 1
        reads = not from_rank0 or dist.get_rank() == 0
        with contextlib.nullcontext() if reads else torch.device("meta"):
            lm = trained_model(policy, model_config, load, weights=reads)
        if policy.freeze_vision_tower:
            for module in vision_tower(lm):
                module.requires_grad_(False)
        if policy.lora.enabled:
            torch.manual_seed(config.seed)  # the same adapters on every rank, whatever loading drew
            layers = attach_adapters(lm, config)
            if self.exact:
                compute_merged(layers)
            self.adapter_scales = {path: float(layer.scaling[ADAPTER]) for path, layer in layers.items()}
        if options.activation_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        full = lm.state_dict() if from_rank0 and reads else None  # what rank 0 sends, before any sharding
        if policy.tensor_parallel_size > 1:
            self.tp_summed = apply_tensor_parallel(lm, self.meshes.tp, adapters=bool(self.adapter_scales))
        #: With expert parallelism: the experts modules, each holding this rank's share of the experts.
        self.parallel_experts = split_experts(split_decoder(lm), self.meshes.ep) if policy.moe.expert_parallel_size > 1 else []
        if self.world_size == 1 and self.compute_dtype == torch.float32:
            # Nothing to shard or cast: FSDP would only copy every weight in and out of its
            # gather buffers twice per step and every gradient through its reduce buffers.
            return CausalLMHead(lm.to(self.device), tie_gradients(lm))
        root = apply_fsdp(
            lm,
            self.meshes,
            param_dtype=self.compute_dtype,
            reduce_dtype=torch_dtype(options.reduce_dtype),
            reshard_after_forward=options.reshard_after_forward,
            experts=self.parallel_experts,
        )
        if not from_rank0:
            return root.to(self.device)
        root = root.to(self.device) if reads else root.to_empty(device=self.device)
        load_from_rank0(root, full)
        return root

    # ------------------------------------------------------------------ forward passes

    def _rows(self, mb: Batch, batching: Batching) -> ModelRows:
        rows = microbatch_rows(
            mb["input_ids"],
            mb["input_lengths"],
            packing_tokens_per_row=batching.packing_tokens_per_row,
            round_to=batching.round_to,
            attn_implementation=self.options.attn_implementation,
        )
        return rows.to(self.device)

    def _forward(
        self, mb: Batch, rows: ModelRows, head: Callable[[torch.Tensor, torch.Tensor], Any],
        routes: torch.Tensor | None = None,
    ) -> Any:
        """The model on ``rows`` (of microbatch ``mb``, whose images it is given) through
        ``head``; with ``routes`` (per-sample [b, S, layers, k], ``policy.moe``) its routers are
        given them: counted, and used with routing replay. They stay set for the backward pass
        (a checkpointed layer recomputes its forward there)."""
        self._require_on_device("a forward pass")
        if self.routers is not None:
            laid_out = None
            if routes is not None:  # padding keeps no route, whatever a data plane padded the field with
                laid_out = rows.lay_out(routes.to(self.device), NO_ROUTE)
                laid_out = torch.where(rows.valid[..., None, None], laid_out, NO_ROUTE).flatten(0, 1)
            self.routers.set(laid_out, apply=self.replay_routes)
        if self.router_logits is not None:
            self.router_logits.valid = rows.valid.reshape(-1)  # the routers see the rows' tokens flattened
        images = image_model_inputs(mb, rows, self.model.lm)
        positions = images.pop("position_ids", rows.position_ids)
        return self.model(rows.input_ids, rows.attention_mask, positions, head, rows.segment_bounds, **images)

    def _microbatch_logprobs(self, mb: Batch, batching: Batching) -> torch.Tensor:
        """Logprobs [b, S] of a microbatch on the device (of ``logits / self.temperature``),
        0 where not reported (with exact logprobs: also off the generated tokens)."""
        mask = mb["token_mask"] if "token_mask" in mb else None
        rows = exact_rows(mb["input_ids"], mb["input_lengths"], mask).to(self.device) if self.exact else self._rows(mb, batching)
        chunk, temperature, softcap = self.config.policy.logprob_chunk_size, self.temperature, self.logit_softcap
        min_rows = MIN_ROWS if self.exact else 0
        scored = rows.scored(mask)
        values = self._forward(mb, rows, lambda h, w: sequence_logprobs(
            h, w, rows.input_ids, scored, chunk, temperature, softcap=softcap, min_rows=min_rows
        ), mb[ROUTES_FIELD] if ROUTES_FIELD in mb else None)
        keep = loss_positions(mb["input_lengths"], rows.width, mask)
        return torch.where(keep.to(self.device), rows.to_samples(values), 0.0)

    def _microbatch_values(self, mb: Batch, batching: Batching) -> torch.Tensor:
        """Value-head outputs [b, S] of a microbatch on the device, in float32, 0 on padding."""
        rows = self._rows(mb, batching)
        # [.., H] @ [H]: a new tensor; FSDP2 warns when the root module returns a view (e.g. of a [.., 1] product)
        values = self._forward(mb, rows, lambda h, w: h.float() @ w.float()[0])
        keep = torch.arange(rows.width)[None, :] < mb["input_lengths"][:, None]
        return torch.where(keep.to(self.device), rows.to_samples(values), 0.0)

    def _microbatch_topk_logprobs(self, mb: Batch, batching: Batching) -> torch.Tensor:
        """Logprobs [b, S, k] of the ids ``mb['topk_indices']`` [b, S-1, k] (index ``t - 1``
        predicts token ``t``) at each position, at the logprob temperature; 0 where not reported."""
        mask = mb["token_mask"] if "token_mask" in mb else None
        rows = self._rows(mb, batching)
        ids = torch.nn.functional.pad(mb["topk_indices"], (0, 0, 1, 0)).to(self.device)  # onto the logprob positions
        ids = rows.lay_out(ids)
        chunk, temperature, softcap = self.config.policy.logprob_chunk_size, self.temperature, self.logit_softcap
        scored = rows.scored(mask)
        values = self._forward(
            mb, rows, lambda h, w: sequence_logprobs(h, w, ids, scored, chunk, temperature, softcap=softcap)
        )
        keep = loss_positions(mb["input_lengths"], rows.width, mask)
        return torch.where(keep.to(self.device)[..., None], rows.to_samples(values), 0.0)

    def _loss_inputs(self, kind: str, mb: Batch, batching: Batching) -> torch.Tensor:
        """What a loss of ``input_type`` ``kind`` receives for the microbatch."""
        compute = {"logprobs": self._microbatch_logprobs, "topk_logprobs": self._microbatch_topk_logprobs,
                   "values": self._microbatch_values}[kind]
        return compute(mb, batching)

    def _inference(self, work: RankWork, compute: Callable[[Batch, Batching], torch.Tensor],
                   chosen_routes: torch.Tensor | None = None) -> torch.Tensor:
        """``compute`` of every microbatch of this rank's samples, without gradients, in eval mode: [n, S].
        With ``chosen_routes`` ([n, S, layers, k]): filled with the experts the routers chose for each token."""
        shard = work.batch
        out = torch.zeros(shard["input_ids"].shape, dtype=torch.float32)
        self.model.eval()
        if chosen_routes is not None:
            self.routers.record = True
        try:
            with torch.no_grad():
                for idx in work.microbatches:
                    mb = shard.select(idx)
                    out[idx] = compute(mb, work.batching).cpu()
                    if chosen_routes is not None:
                        chosen_routes[idx] = self._chosen_routes(mb, work.batching)
        finally:
            if self.routers is not None:
                self.routers.record = False
        reshard_all(self.model)
        if self.routers is not None:
            self.routers.agreement_counts()  # the training pass reports the agreement, not this one
        return out

    def _chosen_routes(self, mb: Batch, batching: Batching) -> torch.Tensor:
        """The experts the routers chose in the forward just run on microbatch ``mb`` (padded or
        packed rows, as :meth:`_rows` lays them out), per sample: int16 [b, S, layers, k],
        :data:`NO_ROUTE` past each sample's length."""
        rows = self._rows(mb, batching)
        taken = self.routers.take().to(self.device)  # [rows x width, layers, k]
        chosen = rows.to_samples(taken.view(*rows.valid.shape, *taken.shape[1:]))
        real = torch.arange(chosen.shape[1], device=self.device)[None, :] < mb["input_lengths"].to(self.device)[:, None]
        return torch.where(real[..., None, None], chosen, NO_ROUTE).cpu()

    def logprobs(self, work: RankWork, reference: bool = False) -> Batch:
        """``logprobs`` [n, S] of this rank's samples (current or reference weights); with
        ``policy.moe.routing_replay: previous`` (current weights) also ``routed_experts`` [n, S,
        layers, k], the experts its routers chose, for the training passes to replay."""
        if reference:
            with self._reference_weights():
                return Batch({"reference_logprobs": self._inference(work, self._microbatch_logprobs)})
        if not self.returns_routes:
            return Batch({"logprobs": self._inference(work, self._microbatch_logprobs)})
        k = self.model.lm.config.get_text_config().num_experts_per_tok
        routes = torch.full((*work.batch["input_ids"].shape, self.routers.num_layers, k), NO_ROUTE, dtype=ROUTES_DTYPE)
        return Batch({"logprobs": self._inference(work, self._microbatch_logprobs, routes), ROUTES_FIELD: routes})

    def values(self, work: RankWork) -> Batch:
        """``values`` [n, S] of this rank's samples (a value head)."""
        return Batch({"values": self._inference(work, self._microbatch_values)})

    def topk(self, work: RankWork, k: int) -> Batch:
        """``topk_logits``, ``topk_indices`` and ``topk_logprobs`` [n, S-1, k] of this rank's
        samples (0 on padding): raw logits, not divided by the temperature, and the same ids'
        logprobs at the logprob temperature."""
        shard = work.batch
        n, width = shard["input_ids"].shape
        values = torch.zeros((n, width, k), dtype=torch.float32)
        indices = torch.zeros((n, width, k), dtype=torch.long)
        logprobs = torch.zeros((n, width, k), dtype=torch.float32)
        chunk, temperature, softcap = self.config.policy.logprob_chunk_size, self.temperature, self.logit_softcap
        self.model.eval()
        with torch.no_grad():
            for idx in work.microbatches:
                mb = shard.select(idx)
                rows = self._rows(mb, work.batching)

                def head(h: torch.Tensor, w: torch.Tensor, rows: ModelRows = rows) -> tuple[torch.Tensor, ...]:
                    vals, ids = topk_logits(h[rows.valid], w, k, chunk, softcap=softcap)
                    lse = logsumexp_logits(h[rows.valid], w, chunk, temperature, softcap=softcap)
                    out = [vals.new_zeros((*rows.valid.shape, k)), ids.new_zeros((*rows.valid.shape, k)),
                           vals.new_zeros((*rows.valid.shape, k))]
                    out[0][rows.valid], out[1][rows.valid] = vals, ids
                    out[2][rows.valid] = vals / temperature - lse[:, None]
                    return tuple(out)

                vals, ids, lps = self._forward(mb, rows, head)
                values[idx] = rows.to_samples(vals).float().cpu()
                indices[idx] = rows.to_samples(ids).cpu()
                logprobs[idx] = rows.to_samples(lps).float().cpu()
        reshard_all(self.model)
        return Batch({"topk_logits": values[:, :-1], "topk_indices": indices[:, :-1], "topk_logprobs": logprobs[:, :-1]})

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """The reference policy inside the block: the adapters off under LoRA; otherwise the
        reference weights swapped into the model in place, and the current ones back after."""
        if self.adapter_scales:
            reshard_all(self.model)
            with adapters_disabled(self.model):
                yield
            reshard_all(self.model)
            return
        reshard_all(self.model)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            current = {name: _local(p).to("cpu", copy=True) for name, p in params.items()}
            for name, p in params.items():
                _local(p).copy_(self._reference[name])
        try:
            yield
        finally:
            reshard_all(self.model)
            with torch.no_grad():
                for name, p in params.items():
                    _local(p).copy_(current[name])

    # ------------------------------------------------------------------ training

    def train(self, work: RankWork, loss_fn: LossFunction, eval_mode: bool = False) -> RankTrainResult:
        """Forward/backward over this rank's microbatches, then (unless ``eval_mode``) one
        clipped optimizer step. Returns this rank's shares of the loss and loss metrics
        (``loss``, ``metrics``) and the step's ``grad_norm``, ``lr``, ``num_tokens``,
        ``step_time_s``."""
        start = time.perf_counter()
        if self.optimizer_offloaded and not eval_mode:
            raise RuntimeError(f"dtensor policy rank {self.rank}: a training step while the optimizer state is in CPU "
                               "memory (onload_weights() brought the weights alone back); call prepare_for_training() "
                               "first")
        shard = work.batch
        seqs, toks = global_valid_counts(shard, self.dp_group, self.device)  # NCCL reduces on the GPU only
        self.model.train(not eval_mode)
        loss_total = 0.0
        parts = []
        with torch.no_grad() if eval_mode else contextlib.nullcontext():
            for idx in work.microbatches:
                mb = shard.select(idx)
                if self.router_logits is not None:
                    self.router_logits.recording = True
                outputs = self._loss_inputs(loss_fn.input_type, mb, work.batching)
                loss, metrics = loss_fn(outputs, mb.to(self.device), seqs, toks)
                total = loss
                if self.router_logits is not None:
                    router_loss, router_metrics = self._router_terms(mb, toks)
                    total, metrics = loss + router_loss, {**metrics, **router_metrics}
                if not eval_mode:
                    total.backward()
                loss_total += float(loss.detach())
                parts.append(metrics)
        if self.routers is not None:  # counts of tokens: summed over ranks, then fractions (agreement_metrics)
            parts.append(self.routers.agreement_counts())
        result: RankTrainResult = {
            "loss": loss_total,
            "metrics": combine_metrics(parts, loss_fn.metric_reductions),
            "num_tokens": float(toks),
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_time_s": 0.0,
        }
        if eval_mode:
            reshard_all(self.model)
        else:
            result["grad_norm"] = self._optimizer_step()
        result["step_time_s"] = time.perf_counter() - start
        return result

    def _router_terms(self, mb: Batch, toks: torch.Tensor) -> tuple[torch.Tensor | float, dict[str, float]]:
        """The router losses of the microbatch's forward (``policy.moe``: each weighed by its
        coefficient) and their metrics, as this microbatch's share of the step: its loss tokens
        over the step's (``toks``), so that the shares of every microbatch and rank add up to
        the step's token-weighted mean."""
        logits, valid = self.router_logits.take(), self.router_logits.valid
        self.router_logits.recording = False  # a checkpointed layer's recomputation in backward is not kept
        sample_mask = mb["sample_mask"] if "sample_mask" in mb else torch.ones(len(mb))
        share = float((mb["token_mask"] * sample_mask[:, None]).sum()) / max(float(toks), 1.0)
        if share == 0.0 or not bool(valid.any()):
            return 0.0, {}
        moe = self.config.policy.moe
        with contextlib.nullcontext() if moe.router_losses else torch.no_grad():
            assigned = expert_assignments(logits, valid, self.model.lm.config.get_text_config().num_experts_per_tok)
            aux, z = load_balancing_loss(assigned, valid), z_loss(logits, valid)
        loads = expert_loads(assigned)
        metrics = {AUX_LOSS_METRIC: float(aux.detach()) * share, Z_LOSS_METRIC: float(z.detach()) * share,
                   **{f"{EXPERT_LOAD_METRIC}/layer_{i:02d}": load * share for i, load in enumerate(loads)}}
        if not moe.router_losses:
            return 0.0, metrics
        return (moe.aux_loss_coef * aux + moe.z_loss_coef * z) * share, metrics

    def _optimizer_step(self) -> float:
        sum_gradients(self.tp_summed, self.meshes.tp.get_group())
        norm = total_grad_norm(self.trained)
        max_norm = self.config.policy.max_grad_norm
        if max_norm is not None:
            clip_grads_(self.trained, max_norm, norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    # ------------------------------------------------------------------ checkpoints and weights

    def save_checkpoint(self, path: str) -> None:
        reshard_all(self.model)
        checkpoint.save_sharded(path, self.model, self.optimizer,
                                {"scheduler": self.scheduler.state_dict(), "step": self.step})

    def load_checkpoint(self, path: str) -> None:
        reshard_all(self.model)
        state = checkpoint.load_sharded(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]

    def weight_metadata(self) -> list[ParamMeta]:
        """Every tensor a weight sync sends (:meth:`_synced_view`): name, full (global) shape,
        ``policy.dtype``; no gather."""
        return _metadata(self.synced, self.compute_dtype)

    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Collective: the named full tensors of :meth:`weight_metadata` on rank 0 (CPU,
        ``policy.dtype``); None elsewhere."""
        return self._gather(self.synced, names)

    def gather_sync_weights(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """:meth:`gather_weights` left on the training device."""
        return self._gather(self.synced, names, self.device)

    def _gather(self, view: WeightView, names: list[str], device: torch.device | str = "cpu") -> dict[str, torch.Tensor] | None:
        self._require_on_device("a gather of the weights")  # a collective, on the process group's device
        reshard_all(self.model)
        full = view.gather(names, self.compute_dtype, device)
        return full if self.rank == 0 else None

    def export_hf(self, path: str, shard_bytes: int) -> None:
        """Collective: a Hugging Face folder at ``path`` (written by rank 0). Under LoRA: the
        adapters as a PEFT folder at ``path`` and, with ``policy.lora.export_merged``, the
        merged model as a Hugging Face folder at ``path/merged``."""
        policy, lm = self.config.policy, self.model.lm
        if not self.adapter_scales:
            self._export_model(path, FullWeights(lm), shard_bytes)
            return
        adapters = AdapterWeights(lm, self.adapter_scales)
        tensors = self._gather(adapters, [name for name, _ in adapters.named()])
        if tensors is not None:
            write_adapter_folder(path, tensors, policy.lora, policy.model)
        if policy.lora.export_merged:
            self._export_model(str(Path(path) / MERGED_FOLDER), MergedWeights(lm, self.adapter_scales), shard_bytes)
        dist.barrier()

    def _export_model(self, path: str, view: WeightView, shard_bytes: int) -> None:
        """Collective: ``view``'s tensors as a Hugging Face model folder at ``path``."""
        policy, lm = self.config.policy, self.model.lm
        sizes = [(meta.name, meta.nbytes) for meta in _metadata(view, self.compute_dtype)]

        def gather(names: list[str]) -> dict[str, torch.Tensor] | None:
            full = self._gather(view, names)  # in transformers' in-memory layout; the folder holds the checkpoint's
            return None if full is None else dict(checkpoint_tensors(lm, full.items()))

        if write_hf_shards(path, sizes, gather, shard_bytes, writer=self.rank == 0):
            write_hf_metadata(path, lm.config, policy.tokenizer or policy.model, self.compute_dtype,
                              getattr(lm, "generation_config", None), model_source=policy.model)
        dist.barrier()

    # ------------------------------------------------------------------ placement

    def _require_on_device(self, what: str) -> None:
        """Raise when the state is offloaded: ``what`` needs it on the training device (the
        driver brings it back first; the check holds on CPU too, where nothing moves)."""
        if self.offloaded:
            raise RuntimeError(f"dtensor policy rank {self.rank}: {what} while the weights are offloaded to CPU memory "
                               "(offload() was called, as colocated generation does); call prepare_for_training() first")

    def offload(self) -> None:
        """Move weights and optimizer state to CPU memory (nothing moves on CPU training, where
        they are already there). Until :meth:`prepare_for_training`, forward passes, training,
        gathers and exports raise, on every device alike; checkpoints still work."""
        self.offloaded = self.optimizer_offloaded = True
        self._move_to(torch.device("cpu"))

    def prepare_for_training(self) -> None:
        """Bring weights and optimizer state back onto the training device."""
        self.offloaded = self.optimizer_offloaded = False
        self._move_to(self.device)

    def onload_weights(self) -> None:
        """Bring the weights back onto the training device, the optimizer state staying in CPU
        memory (a weight sync or an export of an offloaded policy: on a GPU shared with the
        engines, Adam's moments would take twice the weights' memory there meanwhile). Passes
        and gathers run; a training step raises until :meth:`prepare_for_training`."""
        self.offloaded = False
        self._move_to(self.device, optimizer=False)

    def _move_to(self, device: torch.device, optimizer: bool = True) -> None:
        if self.device.type == "cpu":
            return
        reshard_all(self.model)
        self.model.to(device)
        for state in self.optimizer.state.values() if optimizer else ():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        else:
            torch.cuda.empty_cache()

    def info(self) -> dict[str, Any]:
        """Facts for logs; ``trained_parameters`` counts what the optimizer steps (the
        adapters alone under LoRA); ``experts_per_rank``: with expert parallelism, the experts
        of each layer this rank holds (None without)."""
        numel = sum(p.numel() for p in self.model.parameters())
        return {
            "backend": "dtensor",
            "parameters": numel,
            "trained_parameters": sum(p.numel() for p in self.trained),
            "world_size": self.world_size,
            "data_parallel_size": self.meshes.dp.size(),
            "tensor_parallel_size": self.meshes.tp.size(),
            "expert_parallel_size": self.meshes.ep.size(),
            "experts_per_rank": self.parallel_experts[0].num_experts if self.parallel_experts else None,
            "device": str(self.device),
            "dtype": str(self.compute_dtype).removeprefix("torch."),
            "pid": os.getpid(),
        }
