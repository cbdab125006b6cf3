"""The ``generation.vllm`` config section: options of the vLLM generation backend.

Model, dtype, sampling, stop criteria, the number of engines (``generation.num_workers``,
data parallel), ``generation.tensor_parallel_size`` and actor resources are in the core
``generation`` section.
"""

from __future__ import annotations

from typing import Any

import attrs

SECTION = "generation.vllm"


@attrs.define
class VllmGenerationConfig:
    """Options of the ``vllm`` generation backend.

    - ``max_model_len``: tokens per row (prompt + completion); None uses
      ``policy.max_total_sequence_length``.
    - ``enforce_eager``: skip torch.compile and CUDA graphs (much faster start; on CPU
      compilation adds 8-21% throughput for 10-24 s of start-up).
    - ``gpu_memory_utilization``: fraction of GPU memory the engine may take (GPU only).
    - ``kv_cache_space_gib``: KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``); without it
      vLLM on CPU reserves most of the machine's RAM.
    - ``detokenize``: load the tokenizer in the engine, which stop strings need. None: only
      when ``generation.stop_strings`` is set; set true when batches bring their own
      ``stop_strings`` (multi-turn environments).
    - ``enable_sleep_mode``: on CUDA with ``generation.colocated``, release weights and KV
      cache between generations (vLLM sleep level 1). Ignored on CPU, where vLLM refuses it.
    - ``engine_kwargs``: passed to ``vllm.LLM`` as is (e.g. ``max_num_seqs``), overriding
      what the backend sets.
    """

    max_model_len: int | None = None
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.6
    kv_cache_space_gib: float = 1.0
    detokenize: bool | None = None
    enable_sleep_mode: bool = True
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict)
