"""This rank's megatron-core ``GPTModel`` for a Hugging Face folder, and its weights in
Hugging Face terms.

The model is built from :class:`~posttrain_megatron.convert.Architecture` with megatron-core's
local layers (runs on any device; :class:`RMSNorm` as its layer norm; a mixture of experts' layers
with one module per expert and the all-to-all token dispatcher) or Transformer Engine's, holds
this rank's pipeline stage (``pre_process`` on the first, ``post_process`` on the last) and
its tensor-parallel slices. Its forward stops after the final layer norm
(:class:`HiddenStateGPTModel`): the vocabulary-chunked head of :mod:`posttrain.backend.logprobs`
replaces the logits layer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from safetensors import safe_open

from posttrain.config.schema import PolicyConfig
from posttrain.errors import ConfigError
from posttrain_megatron.config import MegatronConfig
from posttrain_megatron.convert import (
    Architecture,
    checkpoint_names,
    expert_of,
    hf_sources,
    to_megatron,
    tp_shard,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


class HiddenStateGPTModel(GPTModel):
    """A ``GPTModel`` whose forward returns the final hidden states ``[s, b, h]`` (after the
    final layer norm; ``s`` split over tensor-parallel ranks with sequence parallelism)
    instead of logits; the output layer's weight is still its parameter."""

    def _postprocess(self, hidden_states, **_):
        return hidden_states


def transformer_config(arch: Architecture, policy: PolicyConfig, options: MegatronConfig, *,
                       on_gpu: bool) -> TransformerConfig:
    """megatron-core's config: the architecture, the parallel layout and posttrain's choices
    (no fused kernels that need Apex; the loss normalised by posttrain, so gradients are
    summed, not averaged, over data-parallel ranks and microbatches; megatron-core's routing
    replay hooks in the routers when ``policy.moe`` gives them routes)."""
    dtype = getattr(torch, policy.dtype)
    return TransformerConfig(
        **arch.transformer_config_kwargs(),
        tensor_model_parallel_size=policy.tensor_parallel_size,
        pipeline_model_parallel_size=options.pipeline_parallel_size,
        context_parallel_size=options.context_parallel_size,
        expert_model_parallel_size=policy.moe.expert_parallel_size,
        moe_enable_routing_replay=arch.is_moe and policy.moe.routes_key is not None,
        sequence_parallel=options.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # the Hugging Face weights overwrite the initial ones, but megatron-core marks its
        # tensor-parallel parameters (which gradient norms and checkpoints rely on) only while
        # initialising them
        perform_initialization=True,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,  # microbatches of one pass differ in length
        moe_token_dispatcher_type="alltoall",  # (the default refuses variable lengths)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


class RMSNorm(torch.nn.Module):
    """The RMS layer norm of posttrain's local layer spec: ``torch.nn.RMSNorm`` arithmetic,
    usable with sequence parallelism (megatron-core's own torch norm refuses it; its fused
    ones need Apex). Under sequence parallelism each tensor-parallel rank normalises its part
    of the sequence, so the weight is marked ``sequence_parallel`` and megatron-core sums its
    gradient over those ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.eps)


def layer_spec(config: TransformerConfig, arch: Architecture, options: MegatronConfig) -> TransformerBlockSubmodules:
    """The decoder's layers on this pipeline stage: Transformer Engine's, or megatron-core's
    local layers with :class:`RMSNorm` (a dense MLP or the experts, per layer)."""
    if options.transformer_impl == "transformer_engine":
        try:
            return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
        except (ImportError, AssertionError) as exc:
            raise ConfigError(
                "policy.megatron.transformer_impl=transformer_engine, but Transformer Engine cannot be used in "
                f"the policy workers' environment ({exc}); install transformer-engine there or use 'local'"
            ) from exc
    dense, experts = _local_layer(config, None), _local_layer(config, arch.num_experts or None)
    first = get_transformer_layer_offset(config)
    layers = [experts if arch.has_experts(first + i) else dense
              for i in range(get_num_layers_to_build(config))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


def _local_layer(config: TransformerConfig, num_experts: int | None):
    layer = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:  # Qwen 3's norms of each query and key head
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    return layer


def build_model(arch: Architecture, config: TransformerConfig, options: MegatronConfig) -> HiddenStateGPTModel:
    """This rank's pipeline stage of the model, randomly initialised (load weights next)."""
    return HiddenStateGPTModel(
        config,
        layer_spec(config, arch, options),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **arch.gpt_model_kwargs(config.tensor_model_parallel_size),
    )


def fused_norms(options: MegatronConfig) -> bool:
    """Whether layer norms live inside the next linear layer (Transformer Engine spec)."""
    return options.transformer_impl == "transformer_engine"


def output_weight(model: GPTModel) -> torch.Tensor:
    """This rank's rows of the output embedding (padded vocabulary) on the last stage."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def named_parameters(model: GPTModel) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global megatron name, parameter)``: layer numbers counted over all pipeline stages,
    experts over the expert-parallel ranks (rank ``r`` of ``ep`` holds experts ``r * E / ep``
    onwards)."""
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    first_expert = (parallel_state.get_expert_model_parallel_rank() * (model.config.num_moe_experts or 0)
                    // parallel_state.get_expert_model_parallel_world_size())
    for name, param in model.named_parameters():
        name = _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{first_expert + int(m.group(1))}.", name)
        yield _LAYER.sub(lambda m: f"decoder.layers.{offsets[int(m.group(1))]}.", name), param


class HFTensors:
    """Read single tensors of a Hugging Face safetensors folder (one file or an index)."""

    def __init__(self, folder: str):
        root = Path(folder)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: root / file for name, file in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            with safe_open(root / "model.safetensors", "pt") as f:
                self.files = {name: root / "model.safetensors" for name in f.keys()}  # noqa: SIM118
        else:
            raise ConfigError(
                f"policy.model: '{folder}' holds no model.safetensors or model.safetensors.index.json; the "
                "megatron backend reads safetensors weights (save the model with safe_serialization=True)"
            )

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConfigError(f"policy.model: the weights have no tensor '{name}', which the model config implies")
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)

    def in_memory(self, arch: Architecture, hf_name: str, expert: int | None = None) -> torch.Tensor:
        """transformers' in-memory tensor ``hf_name`` (with ``expert``, that expert's slice of
        a packed experts tensor), whether the checkpoint stores it as such or per expert."""
        if hf_name in self.files:
            whole = self.get(hf_name)
            return whole if expert is None else whole[expert]
        return torch.cat([self.get(name) for name in checkpoint_names(arch, hf_name, expert)])


@torch.no_grad()
def load_hf_weights(model: GPTModel, arch: Architecture, folder: str, *, fused: bool) -> None:
    """Copy the Hugging Face weights of ``folder`` into this rank's parameters."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    expert_tp = parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    tensors = HFTensors(folder)
    for name, param in named_parameters(model):
        expert = expert_of(name)
        if expert is None:
            sources = [tensors.in_memory(arch, s) for s in hf_sources(arch, name, fused_norms=fused)]
            param.copy_(tp_shard(name, to_megatron(arch, name, sources, tp_size=tp_size), tp_rank, tp_size))
        else:  # one expert, read alone
            stacked, index = expert
            param.copy_(tp_shard(name, tensors.in_memory(arch, hf_sources(arch, stacked)[0], index), *expert_tp))
