"""``hf`` engines inside the policy's workers (``generation.in_policy_workers``): no process of
their own, yet the same samples as engines in their own processes, and after training the
refit (in memory) gives them the policy's weights: the dtensor policy on one rank and on two,
megatron on two."""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.backend.hosted import HostedGroup
from posttrain.config.schema import GenerationConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import check_trained_policy_refit, prompt_batch

pytestmark = pytest.mark.ray

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]


def run_config(model: str, workers: int, *, in_policy: bool, backend: str = "dtensor") -> RunConfig:
    return RunConfig(
        seed=5,
        policy=PolicyConfig(
            backend=backend, model=model, num_workers=workers, train_global_batch_size=len(PROMPTS),
            train_micro_batch_size=len(PROMPTS) // workers, optimizer=OptimizerConfig(lr=3e-2),
            resources=WorkerResources(cpus=0.5),
        ),
        generation=GenerationConfig(
            backend="hf", temperature=1.0, max_new_tokens=12, num_workers=workers, in_policy_workers=in_policy,
            resources=WorkerResources(cpus=0.5),
        ),
    )


@pytest.mark.parametrize(("backend", "workers"), [("dtensor", 1), ("dtensor", 2), ("megatron", 2)])
def test_engines_in_policy_workers_sample_what_their_own_processes_sample(ray_cluster, tiny_model_path, backend, workers):
    """Before and after a training step and a refit (in memory on the policy's side, a
    broadcast to the separate engines), both kinds of engines return the same tokens and
    logprobs and the weight version the refit named; after it they match the policy's own
    logprobs (:func:`check_trained_policy_refit`)."""
    host = plugin_host()
    config = run_config(tiny_model_path, workers, in_policy=True, backend=backend)
    cluster = VirtualCluster(config.cluster)
    policy = host.policy_backends[backend](config, cluster)
    inside = host.generation_backends["hf"](config, cluster, host=policy)
    apart = host.generation_backends["hf"](attrs.evolve(config, generation=attrs.evolve(
        config.generation, in_policy_workers=False)), cluster)
    try:
        assert isinstance(inside._group, HostedGroup) and inside._group.world_size == workers
        first = [g.generate(prompt_batch(PROMPTS)) for g in (inside, apart)]
        check_trained_policy_refit(policy, inside, PROMPTS, bucket_bytes=20_000, max_difference=1e-5)
        stats = refit(policy, apart, 20_000, version=7)
        inside_stats = refit(policy, inside, 20_000, version=7)
        assert inside_stats.transport == "in process" and inside_stats.bytes_moved == stats.bytes_moved
        for g in (inside, apart):
            g.set_sampling_seed(3)
        second = [g.generate(prompt_batch(PROMPTS)) for g in (inside, apart)]
    finally:
        apart.shutdown()
        inside.shutdown()
        inside.shutdown()  # twice is safe
        policy.shutdown()
    for ours, theirs in (first, second):
        assert torch.equal(ours["output_ids"], theirs["output_ids"])
        torch.testing.assert_close(ours["logprobs"], theirs["logprobs"], rtol=0, atol=1e-6)
    assert second[0]["weight_versions"].tolist() == [7] * len(PROMPTS)
    assert not torch.equal(first[0]["output_ids"], second[0]["output_ids"])
