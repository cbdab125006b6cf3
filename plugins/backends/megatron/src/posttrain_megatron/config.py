"""The backend's own configuration section, ``policy.megatron``, and its checks.

The core ``policy`` section says the model, dtype, the tensor-parallel size, batch sizes,
optimizer, schedule and dynamic batching; this section holds what is specific to
megatron-core, the pipeline and context parallel sizes included (data parallel is what
remains of ``policy.num_workers``: :meth:`MegatronConfig.replica_factors` tells core).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import attrs

from posttrain.config.requirements import Requirement
from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain_megatron.convert import Architecture

SECTION = "policy.megatron"
DTYPE_NAMES = ("float32", "bfloat16")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
OPTIMIZERS = ("adamw", "adam", "sgd")


@attrs.define
class MegatronConfig:
    """Options of the ``megatron`` policy backend.

    - ``pipeline_parallel_size``: pipeline stages (each holds an equal share of the layers).
    - ``context_parallel_size``: ranks that split each sequence (needs
      ``transformer_impl: transformer_engine``, a GPU).
    - ``transformer_impl``: ``local`` (megatron-core's own layers; runs anywhere, the CPU
      included) or ``transformer_engine`` (NVIDIA Transformer Engine layers and fused
      attention; GPU, needed for context parallelism).
    - ``sequence_parallel``: with tensor parallelism, split the activations outside
      attention and MLP (layer norms, dropout) along the sequence over the tensor-parallel
      ranks (less activation memory).
    - ``distributed_optimizer``: shard the optimizer state and fp32 master weights over
      the data-parallel ranks (ZeRO-1). Needs ``policy.optimizer.name`` adamw or adam.
    - ``grad_reduce_in_fp32``: accumulate and reduce gradients in float32 even when
      ``policy.dtype`` is bfloat16.
    - ``weight_decay_norms_and_biases``: apply ``policy.optimizer.weight_decay`` to layer
      norms and biases too (as the dtensor backend does); megatron's usual choice, False,
      exempts them.
    """

    #: Expert parallelism (``policy.moe.expert_parallel_size``): megatron-core's experts split over
    #: expert-parallel ranks carved from the data-parallel ones, tokens sent by all-to-all.
    splits_experts: ClassVar[bool] = True
    #: Routing replay and router agreement (``policy.moe``), through megatron-core's replay hook.
    replays_routed_experts: ClassVar[bool] = True
    requires: ClassVar[tuple[Requirement, ...]] = (
        Requirement("megatron.core", "pip install 'megatron-core>=0.16.1'", distribution="megatron-core", minimum="0.16.1"),
    )

    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    transformer_impl: str = "local"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True
    weight_decay_norms_and_biases: bool = True

    def replica_factors(self) -> list[tuple[str, int]]:
        """The parallel sizes this backend adds to one data-parallel replica (after tensor
        parallel), by config key: core divides ``policy.num_workers`` by their product."""
        return [
            (f"{SECTION}.pipeline_parallel_size", self.pipeline_parallel_size),
            (f"{SECTION}.context_parallel_size", self.context_parallel_size),
        ]


def options_of(config: RunConfig) -> MegatronConfig:
    return config.sections.get(SECTION) or MegatronConfig()


def validate_policy_config(config: RunConfig) -> None:
    """The megatron backend's own checks, before any worker starts (core checks the
    parallel and batch arithmetic): its options, and that it converts the model
    (:func:`check_model`; the model's own sizes are checked when it is read)."""
    p = config.policy
    options = options_of(config)
    if p.dtype not in DTYPE_NAMES:
        raise ConfigError(f"policy.dtype: the megatron backend trains in {', '.join(DTYPE_NAMES)}, got '{p.dtype}'")
    if options.transformer_impl not in TRANSFORMER_IMPLS:
        raise ConfigError(
            f"{SECTION}.transformer_impl: expected one of {', '.join(TRANSFORMER_IMPLS)}, got '{options.transformer_impl}'"
        )
    if p.optimizer.name not in OPTIMIZERS:
        raise ConfigError(
            f"policy.optimizer.name: expected one of {', '.join(OPTIMIZERS)}, got '{p.optimizer.name}'"
        )
    if options.distributed_optimizer and p.optimizer.name == "sgd":
        raise ConfigError(
            f"{SECTION}.distributed_optimizer needs policy.optimizer.name adamw or adam (megatron-core shards only "
            "Adam state), got 'sgd'"
        )
    if options.sequence_parallel and p.tensor_parallel_size == 1:
        raise ConfigError(
            f"{SECTION}.sequence_parallel splits activations over tensor-parallel ranks and needs "
            "policy.tensor_parallel_size > 1; set it to false or raise the tensor-parallel size"
        )
    if options.context_parallel_size > 1 and options.transformer_impl != "transformer_engine":
        raise ConfigError(
            f"{SECTION}.context_parallel_size={options.context_parallel_size} needs {SECTION}.transformer_impl=transformer_engine "
            "(megatron-core's context-parallel attention is Transformer Engine's; a GPU is needed)"
        )
    if p.sequence_packing.enabled:
        raise ConfigError(
            "policy.sequence_packing is not implemented by the megatron backend; use policy.dynamic_batching "
            "(microbatches filled up to a token budget) instead"
        )
    check_model(config)


def check_parallel_sizes(arch: Architecture, policy: PolicyConfig, options: MegatronConfig) -> None:
    """Refuse parallel sizes the model's shape does not divide, naming both numbers."""
    tp, pp = policy.tensor_parallel_size, options.pipeline_parallel_size
    sizes = [("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
             ("intermediate_size", arch.ffn_hidden_size)]
    if arch.is_moe:
        sizes.append(("experts' intermediate size", arch.expert_ffn_hidden_size))
    for key, value in sizes:
        if value % tp:
            raise ConfigError(
                f"policy.tensor_parallel_size={tp} does not divide the model's {key}={value}; choose a "
                "tensor-parallel size that divides it"
            )
    if arch.num_layers % pp:
        raise ConfigError(
            f"policy.megatron.pipeline_parallel_size={pp} does not divide the model's num_hidden_layers={arch.num_layers}; "
            "each pipeline stage holds the same number of layers"
        )
    ep = policy.moe.expert_parallel_size
    if ep > 1 and not arch.is_moe:
        raise ConfigError(
            f"policy.moe.expert_parallel_size={ep}, but model type '{arch.model_type}' has no experts to split; "
            "set policy.moe.expert_parallel_size: 1"
        )
    if arch.num_experts % ep:
        raise ConfigError(
            f"policy.moe.expert_parallel_size={ep} does not divide the model's {arch.num_experts} experts per layer; "
            f"choose a size that divides {arch.num_experts} (each rank of an expert-parallel group holds an equal share)"
        )


def check_model(config: RunConfig) -> None:
    """Refuse, from ``config.json`` alone, a ``policy.model`` the backend does not convert
    (:meth:`~posttrain_megatron.convert.Architecture.from_hf_config`: e.g. Gemma, whose
    soft-caps megatron-core cannot apply), parallel sizes its shape does not divide, and
    ``policy.moe`` options it has no experts for. A folder without ``config.json`` is left to
    the model-folder checks, which name what is missing."""
    if not (Path(config.policy.model) / "config.json").is_file():
        return
    from transformers import AutoConfig

    from posttrain_megatron.convert import Architecture

    arch = Architecture.from_hf_config(AutoConfig.from_pretrained(config.policy.model))
    options = options_of(config)
    check_parallel_sizes(arch, config.policy, options)
    moe = config.policy.moe
    if arch.is_moe and config.policy.tensor_parallel_size > 1 and not options.sequence_parallel:
        raise ConfigError(
            f"policy.tensor_parallel_size={config.policy.tensor_parallel_size} on a mixture of experts needs "
            f"{SECTION}.sequence_parallel: true in the megatron backend (megatron-core trains experts split over "
            "tensor-parallel ranks only on a sequence split over them); set it"
        )
    if moe.routes_key is not None and not arch.is_moe:
        raise ConfigError(
            f"{moe.routes_key}: model type '{arch.model_type}' has no experts to route; turn it off for this model"
        )
    if moe.routing_replay != "previous":
        return
    for key, on, off in ((f"{SECTION}.pipeline_parallel_size", options.pipeline_parallel_size > 1, "1"),
                         (f"{SECTION}.sequence_parallel", options.sequence_parallel, "false"),
                         (f"{SECTION}.context_parallel_size", options.context_parallel_size > 1, "1")):
        if on:
            raise ConfigError(
                f"policy.moe.routing_replay: previous records each token's experts in one rank's forward, which "
                f"{key} splits over ranks in the megatron backend; use routing_replay: rollout, or set {key}: {off}"
            )
