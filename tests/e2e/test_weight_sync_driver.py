"""A refit of a 101 MB model from a policy worker process moves no byte through the driver:
during it, the driver puts no object into Ray and receives only small control answers (no tensor); afterwards the
engines sample with the trainer's weights (their logprobs equal the trainer's)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import ray
import torch

from posttrain.batch import Batch
from posttrain.config.schema import GenerationConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.models.tiny import build_tiny_model
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import NegativeLogLikelihood, generated_mask, prompt_batch

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9], [1, 12]]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("small_model"), size="small", seed=0))


class DriverTraffic:
    """Counts what the driver puts into Ray and the pickled size of what it gets back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.puts = 0
        self.received_bytes = 0
        self.tensors: list[str] = []
        put, get = ray.put, ray.get

        def counting_put(*args: Any, **kwargs: Any) -> Any:
            self.puts += 1
            return put(*args, **kwargs)

        def measuring_get(*args: Any, **kwargs: Any) -> Any:
            value = get(*args, **kwargs)
            self.received_bytes += len(pickle.dumps(value))
            self._find_tensors(value, "result")
            return value

        monkeypatch.setattr(ray, "put", counting_put)
        monkeypatch.setattr(ray, "get", measuring_get)

    def _find_tensors(self, value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors.append(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                self._find_tensors(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self._find_tensors(item, f"{where}[{i}]")


@pytest.mark.parametrize(("backend", "colocated"), [("vllm", True), ("hf", False)])
def test_refit_moves_no_bytes_through_the_driver(ray_cluster, small_model, backend, colocated, monkeypatch):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vllm is not installed (pip install 'posttrain-vllm[cpu]')")
    config = RunConfig(
        seed=3,
        policy=PolicyConfig(
            model=small_model, train_global_batch_size=len(PROMPTS), train_micro_batch_size=len(PROMPTS),
            logprob_micro_batch_size=len(PROMPTS), optimizer=OptimizerConfig(lr=1e-2), max_total_sequence_length=64,
            resources=WorkerResources(cpus=0.5), in_driver=False,  # the weights start in a worker process
        ),
        generation=GenerationConfig(backend=backend, temperature=1.0, max_new_tokens=8, colocated=colocated,
                                    refit_bucket_bytes=16 * 1024**2, resources=WorkerResources(cpus=1)),
    )
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends[backend](config, cluster)
    try:
        out = generation.generate(prompt_batch(PROMPTS))
        batch = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"],
                      token_mask=generated_mask(out, PROMPTS).float(), sample_mask=torch.ones(len(PROMPTS)))
        policy.train(batch, NegativeLogLikelihood())  # the trainer's weights now differ from the engines'
        refit(policy, generation, config.generation.refit_bucket_bytes, version=1)  # connects (setup)

        policy.train(batch, NegativeLogLikelihood())
        traffic = DriverTraffic(monkeypatch)
        stats = refit(policy, generation, config.generation.refit_bucket_bytes, version=2)
        monkeypatch.undo()

        assert stats.bytes_moved > 100e6 and stats.num_buckets > 5
        assert stats.transport == "shared memory"  # the engine is on the trainer's node (auto)
        assert traffic.puts == 0, f"the driver put {traffic.puts} object(s) into Ray during the refit"
        assert not traffic.tensors, f"the driver received tensors: {traffic.tensors}"
        assert traffic.received_bytes < 4096, f"the driver received {traffic.received_bytes} bytes during the refit"
        assert stats.peak_staging_bytes < 2 * config.generation.refit_bucket_bytes + stats.bytes_moved // 4

        out = generation.generate(prompt_batch(PROMPTS))
        mask = generated_mask(out, PROMPTS)
        trainer = policy.get_logprobs(Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]))
        difference = (out["logprobs"] - trainer["logprobs"])[mask].abs()
        assert difference.max() < 1e-5, f"engine and trainer logprobs differ by up to {difference.max():.2e}"
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()
