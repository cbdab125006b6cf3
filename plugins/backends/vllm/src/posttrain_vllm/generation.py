"""The ``vllm`` generation backend: vLLM engines in a Ray worker group, refit in place."""

from __future__ import annotations

import logging
from typing import Any

import attrs

from posttrain.backend.generation_group import WorkerGroupGeneration, check_sampling_config
from posttrain.config.schema import RunConfig
from posttrain.distributed import VirtualCluster
from posttrain.log import library_env, library_log_level
from posttrain_vllm.config import BATCH_INVARIANT_VAR, SECTION, VllmGenerationConfig, device_options
from posttrain_vllm.worker import DEFAULT_MAX_NUM_SEQS, VllmEngineWorker


def create_vllm_generation(config: RunConfig, cluster: VirtualCluster) -> WorkerGroupGeneration:
    """``generation.num_workers`` data-parallel vLLM engines, each an actor with
    ``generation.resources`` (on GPU machines ``gpus`` is the whole engine's: its
    ``tensor_parallel_size`` GPUs, or that many shares of one when colocated; an engine of
    several GPUs runs its workers on bundles of its own, see
    :func:`~posttrain_vllm.worker.ray_executor`; on a CPU, ``cpus`` sets the engine's thread
    count).

    The actors' environment gets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    ``VLLM_LOGGING_LEVEL`` (``ERROR``; ``INFO`` at
    ``logger.level: debug``) and the quiet-library variables of :func:`posttrain.log.library_env`
    unless ``generation.resources.env_vars`` sets them; below debug vLLM draws no loading bar.
    With ``generation.exact_logprobs`` (GPUs) it gets ``VLLM_BATCH_INVARIANT=1``, which vLLM
    reads when the engine starts and passes on to the engine's tensor-parallel workers.
    With ``policy.lora.refit: adapter`` the engines start with LoRA on and load the adapters
    each refit sends (:class:`~posttrain_vllm.worker.VllmEngineWorker`).
    """
    check_sampling_config(config)
    options: VllmGenerationConfig = config.sections.get(SECTION) or VllmGenerationConfig()
    gen = config.generation
    max_model_len = options.max_model_len or config.policy.max_total_sequence_length
    lora = config.policy.lora
    adapters = lora if lora.enabled and lora.refit == "adapter" else None
    engine_log_level = library_log_level(config.logger.level)
    engine_env = engine_environment(config)
    return WorkerGroupGeneration(
        config,
        cluster,
        VllmEngineWorker,
        context_length=max_model_len,
        context_key="generation.vllm.max_model_len, default policy.max_total_sequence_length",
        ranks_per_engine=gen.tensor_parallel_size,
        resources=attrs.evolve(gen.resources, env_vars={**engine_env, **gen.resources.env_vars}),
        worker_kwargs=dict(
            model_path=gen.model or config.policy.model,
            dtype=gen.dtype,
            seed=config.seed,
            tensor_parallel_size=gen.tensor_parallel_size,
            max_model_len=max_model_len,
            **device_options(config, options),
            kv_cache_bytes=options.kv_cache_bytes,
            detokenize=options.detokenize if options.detokenize is not None else bool(gen.stop_strings),
            enable_sleep_mode=options.enable_sleep_mode and gen.colocated,
            log_level=engine_log_level,
            engine_kwargs=sized_engine_kwargs(config, options),
            adapters=adapters,
        ),
    )


def engine_environment(config: RunConfig) -> dict[str, str]:
    """The variables the engines' environment gets before ``generation.resources.env_vars``
    (:func:`create_vllm_generation` says which)."""
    return {
        **library_env(config.logger.level),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": logging.getLevelName(library_log_level(config.logger.level)),
        **({BATCH_INVARIANT_VAR: "1"} if config.generation.exact_logprobs else {}),
    }


def sized_engine_kwargs(config: RunConfig, options: VllmGenerationConfig) -> dict[str, Any]:
    """``generation.vllm.engine_kwargs``, where they leave ``max_num_seqs`` unset and the engines
    have no GPU, with ``max_num_seqs`` set to an engine's share of ``generation.rows_per_call``
    (rounded up, at most vLLM's default): the engine then reserves KV cache for those rows
    (:func:`~posttrain_vllm.worker.cpu_kv_cache_bytes`) instead of vLLM's 256, and runs a larger
    call in turns. On GPUs the cache follows ``gpu_memory_utilization`` and nothing changes."""
    kwargs = dict(options.engine_kwargs)
    gen = config.generation
    if gen.rows_per_call is not None and "max_num_seqs" not in kwargs and gen.resources.gpus == 0:
        kwargs["max_num_seqs"] = min(-(-gen.rows_per_call // gen.num_workers), DEFAULT_MAX_NUM_SEQS)
    return kwargs
