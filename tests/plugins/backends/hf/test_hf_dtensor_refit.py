"""Refit from a trained ``dtensor`` policy into the ``hf`` backend: after one training step,
the backend's sampled-token logprobs equal the policy's own ``get_logprobs``, at temperature 1
and at 0.7 (both sides then report logprobs of ``logits / 0.7``)."""

from __future__ import annotations

import pytest

from posttrain.config.schema import GenerationConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.testing.generation import check_trained_policy_refit

pytestmark = pytest.mark.ray

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trained_dtensor_policy_refit_parity(ray_cluster, tiny_model_path, temperature):
    backends = plugin_host().policy_backends
    if "dtensor" not in backends:
        pytest.skip("policy backend 'dtensor' is not registered yet (posttrain-dtensor provides it)")
    config = RunConfig(
        seed=5,
        policy=PolicyConfig(
            model=tiny_model_path, train_global_batch_size=len(PROMPTS), train_micro_batch_size=len(PROMPTS),
            optimizer=OptimizerConfig(lr=3e-2), resources=WorkerResources(cpus=1),
        ),
        generation=GenerationConfig(
            backend="hf", temperature=temperature, max_new_tokens=12, resources=WorkerResources(cpus=1)
        ),
    )
    cluster = VirtualCluster(config.cluster)
    policy = backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["hf"](config, cluster)
    try:
        check_trained_policy_refit(policy, generation, PROMPTS, bucket_bytes=20_000)  # several buckets
    finally:
        generation.shutdown()
        policy.shutdown()
