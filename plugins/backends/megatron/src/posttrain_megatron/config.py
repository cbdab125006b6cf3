"""The backend's own configuration section, ``policy.megatron``, and its checks.

The core ``policy`` section says the model, dtype, the tensor-parallel size, batch sizes,
optimizer, schedule and dynamic batching; this section holds what is specific to
megatron-core, the pipeline and context parallel sizes included (data parallel is what
remains of ``policy.num_workers``: :meth:`MegatronConfig.replica_factors` tells core).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import attrs

from posttrain.config.requirements import Requirement
from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError

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


def check_model(config: RunConfig) -> None:
    """Refuse, from ``config.json`` alone, a ``policy.model`` the backend does not convert
    (:meth:`~posttrain_megatron.convert.Architecture.from_hf_config`: e.g. Gemma, whose
    soft-caps megatron-core cannot apply). A folder without ``config.json`` is left to the
    model-folder checks, which name what is missing."""
    if not (Path(config.policy.model) / "config.json").is_file():
        return
    from transformers import AutoConfig

    from posttrain_megatron.convert import Architecture

    Architecture.from_hf_config(AutoConfig.from_pretrained(config.policy.model))
