"""Refits into vLLM of the architectures whose weights vLLM's reload used to get wrong: tied
output embeddings (Qwen2, Qwen3, Llama with ``tie_word_embeddings``), whose LM head kept its
packed copy from start-up, and mixtures of experts (Qwen3-MoE, Mixtral), whose experts
transformers 5 packs under names vLLM's Mixtral does not load and whose reloaded weights
vLLM-CPU read unpacked. Three training steps, each followed by a refit with checksums on
(every parameter as the engine computes with it equals what the trainer sent), after which
the engine's logprobs equal the trainer's (float32 on both sides)."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.config.schema import GenerationConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.testing.generation import check_trained_policy_refit
from posttrain.testing.zoo import build_zoo_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama_tied", "qwen3_moe", "mixtral"])
def test_three_refits_land_every_weight_and_give_the_trainers_logprobs(ray_cluster, tmp_path, architecture):
    model = str(build_zoo_model(tmp_path / architecture, architecture))
    config = RunConfig(
        seed=5,
        policy=PolicyConfig(
            model=model, max_total_sequence_length=64, train_global_batch_size=len(PROMPTS),
            train_micro_batch_size=len(PROMPTS), optimizer=OptimizerConfig(lr=3e-2), resources=WorkerResources(cpus=1),
        ),
        generation=GenerationConfig(backend="vllm", temperature=1.0, max_new_tokens=12, refit_checksums=True,
                                    resources=WorkerResources(cpus=1)),
    )
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["vllm"](config, cluster)
    try:
        for _ in range(3):  # a refit that leaves anything stale shows by the next one at the latest
            check_trained_policy_refit(policy, generation, PROMPTS, bucket_bytes=20_000, max_difference=1e-4,
                                       mult_prob_error=1 + 1e-5)
    finally:
        generation.shutdown()
        policy.shutdown()
