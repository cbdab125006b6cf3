"""The ``hf`` generation backend: transformers engines in a Ray worker group."""

from __future__ import annotations

from posttrain.backend.generation_group import WorkerGroupGeneration, check_sampling_config
from posttrain.config.schema import RunConfig
from posttrain.distributed import VirtualCluster
from posttrain.errors import ConfigError
from posttrain.interfaces import Policy
from posttrain_hf.config import SECTION, HFGenerationConfig
from posttrain_hf.worker import HFEngineWorker


def create_hf_generation(config: RunConfig, cluster: VirtualCluster, *, host: Policy | None = None) -> WorkerGroupGeneration:
    """``generation.num_workers`` data-parallel transformers engines (the ``hf`` backend), or,
    with a ``host`` policy, one inside each of its workers.

    A row's context (prompt + completion) is limited by the model's ``max_position_embeddings``
    and, with ``generation.exact_logprobs``, by ``policy.max_total_sequence_length`` (the rollout
    keeps no token past it, so every scored completion is one the policy sees whole).
    """
    from transformers import AutoConfig

    check_sampling_config(config)
    options: HFGenerationConfig = config.sections.get(SECTION) or HFGenerationConfig()
    if options.max_batch_size < 1:
        raise ConfigError(f"generation.hf.max_batch_size must be >= 1, got {options.max_batch_size}")
    model_path = config.generation.model or config.policy.model
    context = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)
    context_key = f"max_position_embeddings in {model_path}/config.json"
    exact = config.generation.exact_logprobs
    if exact and (context is None or config.policy.max_total_sequence_length < context):
        context, context_key = config.policy.max_total_sequence_length, "policy.max_total_sequence_length"
    return WorkerGroupGeneration(
        config,
        cluster,
        HFEngineWorker,
        context_length=context or 2**31 - 1,
        context_key=context_key,
        worker_kwargs=dict(
            model_path=model_path,
            dtype=config.generation.dtype,
            max_batch_size=options.max_batch_size,
            attn_implementation=options.attn_implementation,
            exact_chunk_size=config.policy.logprob_chunk_size if exact else None,
            record_routes=config.policy.moe.records_routes,
        ),
        host=host,
    )
