"""The backend's own configuration section, ``policy.dtensor``.

Everything the core ``policy`` section already says (model, dtype, parallel sizes, batch
sizes, optimizer, scheduler, packing, dynamic batching) is read from there; this section
holds only what is specific to FSDP2 / tensor parallel training.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import attrs

from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError

SECTION = "policy.dtensor"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: Attention kernels that keep packed samples apart (segment bounds for sdpa; for eager,
#: transformers' own masks from the restarting positions).
PACKING_ATTENTION = ("sdpa", "eager")


@attrs.define
class DTensorConfig:
    """Options of the ``dtensor`` policy backend.

    - ``attn_implementation``: the attention kernel, ``sdpa`` (PyTorch's fused kernel, causal
      within each packed sample: :mod:`posttrain_dtensor.segment_attention`) or
      ``eager`` (Hugging Face's reference kernel, with its own per-layer block-diagonal masks
      when packing). Both honour the model's sliding windows and attention soft-caps.
    - ``activation_checkpointing``: recompute each decoder layer in the backward pass
      (less memory, about a third more compute).
    - ``reshard_after_forward``: FSDP2 frees the gathered parameters of a layer after its
      forward and gathers them again for backward (less memory, more communication).
    - ``reduce_dtype``: dtype of the gradient reduce-scatter across data-parallel ranks
      (``float32`` keeps accumulation exact when ``policy.dtype`` is bfloat16).

    The backend implements ``policy.lora`` (:mod:`posttrain_dtensor.lora`),
    ``generation.exact_logprobs`` (with ``attn_implementation: sdpa``; under LoRA in float32
    without adapter dropout) and ``policy.moe`` with expert parallelism
    (:mod:`posttrain_dtensor.experts`).
    """

    supports_lora: ClassVar[bool] = True
    supports_muon: ClassVar[bool] = True
    runs_in_driver: ClassVar[bool] = True
    supports_exact_logprobs: ClassVar[bool] = True
    replays_routed_experts: ClassVar[bool] = True
    trains_router_losses: ClassVar[bool] = True
    splits_experts: ClassVar[bool] = True

    attn_implementation: str = "sdpa"
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    reduce_dtype: str = "float32"


def validate_policy_config(config: RunConfig) -> None:
    """The dtensor backend's own checks, before any worker starts (core checks the parallel
    and batch arithmetic, and ``policy.lora``'s values): that the model's config is one the
    backend computes right and, with tensor parallel, whose plan it serves
    (:func:`~posttrain_dtensor.parallel.check_model_fits`); with LoRA, that
    ``policy.lora.target_modules`` adapts linear layers of the model."""
    p = config.policy
    if p.sequence_packing.enabled and p.dynamic_batching.enabled:
        raise ConfigError(
            "policy.sequence_packing.enabled and policy.dynamic_batching.enabled are both true; they are "
            "alternative ways to fill microbatches: enable one"
        )
    options = config.sections.get(SECTION) or DTensorConfig()
    for key, value in (("policy.dtype", p.dtype), (f"{SECTION}.reduce_dtype", options.reduce_dtype)):
        if value not in DTYPE_NAMES:
            raise ConfigError(f"{key}: expected one of {', '.join(DTYPE_NAMES)}, got '{value}'")
    if p.sequence_packing.enabled and options.attn_implementation not in PACKING_ATTENTION:
        raise ConfigError(
            f"policy.sequence_packing needs {SECTION}.attn_implementation in {', '.join(PACKING_ATTENTION)} "
            f"(kernels that keep packed samples apart), got '{options.attn_implementation}'"
        )
    if config.generation.exact_logprobs:
        check_exact_logprobs(config, options)
    check_model(config)
    if p.lora.enabled:
        from posttrain_dtensor.lora import check_targets

        check_targets(config)


def check_exact_logprobs(config: RunConfig, options: DTensorConfig) -> None:
    """What ``generation.exact_logprobs`` needs of this backend: ``sdpa`` attention (run as
    segments of exactly each prefix's length) and, under LoRA, layers that can compute with the
    merged weight a refit sends: float32, no adapter dropout (training's forward must be the
    engines')."""
    from posttrain.config.validate import where_set

    p, key = config.policy, "generation.exact_logprobs"
    problems = []
    if options.attn_implementation != "sdpa":
        problems.append((f"{SECTION}.attn_implementation is '{options.attn_implementation}'; exact logprobs run "
                         f"attention as sdpa segments: set {SECTION}.attn_implementation: sdpa",
                         f"{SECTION}.attn_implementation"))
    if p.lora.enabled and p.lora.dropout > 0:
        problems.append((f"policy.lora.dropout is {p.lora.dropout}: training's forward would not be the engines'; "
                         "set policy.lora.dropout: 0", "policy.lora.dropout"))
    if p.lora.enabled and p.dtype != "float32":
        problems.append((f"policy.lora is on with policy.dtype {p.dtype}: the merged weight a refit sends is computed "
                         "in float32, the layers' own products would be in another dtype; set policy.dtype: float32",
                         "policy.dtype"))
    if p.moe.expert_parallel_size > 1:
        problems.append((f"policy.moe.expert_parallel_size is {p.moe.expert_parallel_size}: each rank's experts would "
                         "run on the tokens of other ranks, which the engines' scoring does not; set "
                         "policy.moe.expert_parallel_size: 1", "policy.moe.expert_parallel_size"))
    if problems:
        message, where = problems[0]
        raise ConfigError(f"{key} is true, but {message}.{where_set(config, key, where)}")


def check_vision_language(config: RunConfig, model_type: str) -> None:
    """Refuse what the backend does not yet do with a vision-language ``policy.model``: score
    its rows as exact logprobs lay them out."""
    from posttrain.config.validate import where_set

    unsupported = [
        (config.generation.exact_logprobs, "generation.exact_logprobs",
         "scores its image rows as exact logprobs lay them out; set generation.exact_logprobs: false"),
    ]
    for refused, key, what in unsupported:
        if refused:
            raise ConfigError(
                f"{key}: policy.model '{config.policy.model}' is a vision-language model ({model_type}), and the "
                f"dtensor backend does not yet handle one where it {what}.{where_set(config, key)}"
            )


def check_model(config: RunConfig) -> None:
    """:func:`~posttrain_dtensor.parallel.check_model_fits` on ``policy.model``'s config (and, with
    expert parallelism, :func:`~posttrain_dtensor.experts.check_expert_parallel`); where
    FSDP will shard the model (several ranks, or a compute dtype other than float32), that a
    weightless copy of it has the decoder layers FSDP wraps. A folder without ``config.json``
    is left to the model-folder checks, which name what is missing."""
    p = config.policy
    if not (Path(p.model) / "config.json").is_file():
        return
    import torch
    from transformers import AutoConfig

    from posttrain.models.auto import generative_class, is_vision_language
    from posttrain_dtensor.parallel import check_model_fits, decoder_layers

    model_config = AutoConfig.from_pretrained(p.model)
    check_model_fits(model_config, p.tensor_parallel_size)
    if p.moe.expert_parallel_size > 1:
        from posttrain_dtensor.experts import check_expert_parallel

        check_expert_parallel(model_config, p.moe.expert_parallel_size)
    if is_vision_language(model_config):
        check_vision_language(config, model_config.model_type)
    if p.head == "lm" and (p.num_workers > 1 or p.dtype != "float32"):
        with torch.device("meta"):
            decoder_layers(generative_class(model_config).from_config(model_config))
