"""The CUDA paths (``nox -s gpu`` on a machine with GPUs; never in CI): dtensor training on a
GPU, vLLM generation, the weight sync over NCCL to a colocated engine (on the policy's GPU)
and to an engine on a GPU of its own, with logprob parity after each, and sleep / wake."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import (
    ClusterConfig,
    GenerationConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import NegativeLogLikelihood, generated_mask, prompt_batch

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.vllm]

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9], [1, 12]]
GPU = WorkerResources(cpus=1, gpus=1)
HALF_GPU = WorkerResources(cpus=1, gpus=0.5)  # colocated: the policy and the engine share one device


def _config(model: str, *, colocated: bool) -> RunConfig:
    return RunConfig(
        seed=1,
        cluster=ClusterConfig(use_gpus=True),
        policy=PolicyConfig(model=model, train_global_batch_size=len(PROMPTS), train_micro_batch_size=2,
                            optimizer=OptimizerConfig(lr=1e-2), max_total_sequence_length=64,
                            resources=HALF_GPU if colocated else GPU),
        generation=GenerationConfig(backend="vllm", max_new_tokens=8, colocated=colocated,
                                    refit_bucket_bytes=1 << 20, resources=HALF_GPU if colocated else GPU),
    )


@pytest.mark.parametrize("colocated", [True, pytest.param(False, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="an engine on a GPU of its own needs 2 GPUs"))])
def test_train_then_sync_over_nccl_gives_the_trainers_logprobs(ray_cluster, tiny_model_path, colocated):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    config = _config(tiny_model_path, colocated=colocated)
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["vllm"](config, cluster)
    try:
        assert policy.info()["device"].startswith("cuda")
        generation.prepare_for_generation()
        out = generation.generate(prompt_batch(PROMPTS))
        mask = generated_mask(out, PROMPTS)
        generation.finish_generation()  # colocated: the engine sleeps while the policy trains
        batch = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"],
                      token_mask=mask.float(), sample_mask=torch.ones(len(PROMPTS)))
        policy.prepare_for_training()
        first = policy.train(batch, NegativeLogLikelihood())
        second = policy.train(batch, NegativeLogLikelihood())
        assert second["loss"] < first["loss"]
        policy.offload()
        stats = refit(policy, generation, config.generation.refit_bucket_bytes, version=1)
        assert generation.weight_endpoint().backend == "nccl" and stats.num_buckets >= 1
        generation.prepare_for_generation()
        out = generation.generate(prompt_batch(PROMPTS))
        mask = generated_mask(out, PROMPTS)
        trainer = policy.get_logprobs(Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]))
        assert (out["logprobs"] - trainer["logprobs"])[mask].abs().max() < 1e-3  # bfloat16-free float32 on both sides
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()
