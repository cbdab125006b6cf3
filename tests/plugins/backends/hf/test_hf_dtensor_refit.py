"""Refit from a trained ``dtensor`` policy into the ``hf`` backend: after one training step,
the backend's sampled-token logprobs equal the policy's own ``get_logprobs``, at temperature 1
and at 0.7 (both sides then report logprobs of ``logits / 0.7``)."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import (
    GenerationConfig,
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
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


def test_lora_policy_refits_merged_weights(ray_cluster, tiny_model_path):
    """A LoRA policy (``policy.lora``, refit merged) after two steps: the engine's logprobs
    equal the policy's within 1e-5, and the refit moved the whole model's bytes."""
    config = RunConfig(
        seed=5,
        policy=PolicyConfig(
            model=tiny_model_path, train_global_batch_size=len(PROMPTS), train_micro_batch_size=len(PROMPTS),
            optimizer=OptimizerConfig(lr=3e-2), resources=WorkerResources(cpus=1),
            lora=LoraConfig(enabled=True, rank=8, alpha=16.0),
        ),
        generation=GenerationConfig(backend="hf", temperature=1.0, max_new_tokens=12, resources=WorkerResources(cpus=1)),
    )
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["hf"](config, cluster)
    try:
        stats = check_trained_policy_refit(policy, generation, PROMPTS, bucket_bytes=20_000, steps=2, max_difference=1e-5)
    finally:
        generation.shutdown()
        policy.shutdown()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert stats.bytes_moved == 4 * sum(p.numel() for p in model.parameters())


def test_an_engine_that_dies_is_named_and_the_trainer_keeps_its_weights(ray_cluster, tiny_model_path):
    """The engine is killed between two syncs: the next one stops within 30 s naming it, the
    policy's weights are unchanged, and a new generation backend takes the weights."""
    import time

    import ray

    from posttrain.batch import Batch
    from posttrain.errors import WorkerError
    from posttrain.run.refit import refit
    from posttrain.testing.generation import prompt_batch

    config = RunConfig(
        seed=5,
        policy=PolicyConfig(model=tiny_model_path, train_global_batch_size=len(PROMPTS),
                            train_micro_batch_size=len(PROMPTS), resources=WorkerResources(cpus=0.5)),
        generation=GenerationConfig(backend="hf", max_new_tokens=4, resources=WorkerResources(cpus=0.5)),
    )
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["hf"](config, cluster)
    replacement = None
    try:
        refit(policy, generation, 20_000, version=1)
        probe = Batch(input_ids=torch.tensor(PROMPTS[2])[None], input_lengths=torch.tensor([len(PROMPTS[2])]))
        before = policy.get_logprobs(probe)["logprobs"]
        ray.kill(generation.weight_endpoint().engines[0], no_restart=True)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"weight sync.*generation engine 0"):
            refit(policy, generation, 20_000, version=2)
        assert time.monotonic() - start < 30
        assert torch.equal(policy.get_logprobs(probe)["logprobs"], before)
        generation.shutdown()  # releases the dead engine's resources
        replacement = plugin_host().generation_backends["hf"](config, cluster)
        refit(policy, replacement, 20_000, version=2)
        assert replacement.generate(prompt_batch(PROMPTS[:1]))["generation_lengths"][0] >= 1
    finally:
        for backend in (replacement, generation):
            if backend is not None:
                backend.shutdown()
        policy.shutdown()
        cluster.shutdown()
