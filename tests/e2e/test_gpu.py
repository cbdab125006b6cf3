"""The CUDA paths (``nox -s gpu`` on a machine with GPUs; never in CI): dtensor training on a
GPU, generation by vLLM and by the hf engine, the weight sync to a colocated engine (on the
policy's GPU), to an engine on a GPU of its own and to engines inside the policy's workers,
with logprob parity after each, sleep / wake, and vLLM's batch-invariant mode under
``generation.exact_logprobs``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
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
from posttrain.distributed.cluster import colocated_groups
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import (
    NegativeLogLikelihood,
    check_trained_policy_refit,
    generated_mask,
    prompt_batch,
)
from posttrain.testing.zoo import ARCHITECTURES as ZOO
from posttrain.testing.zoo import build_zoo_model

pytestmark = [pytest.mark.gpu, pytest.mark.ray]

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9], [1, 12]]
GPU = WorkerResources(cpus=1, gpus=1)
HALF_GPU = WorkerResources(cpus=1, gpus=0.5)  # colocated: the policy and the engine share one device


def _config(model: str, *, engine: str, colocated: bool, in_policy_workers: bool = False,
            transport: str = "auto") -> RunConfig:
    return RunConfig(
        seed=1,
        cluster=ClusterConfig(use_gpus=True),
        policy=PolicyConfig(model=model, dtype="float32", train_global_batch_size=len(PROMPTS), train_micro_batch_size=2,
                            optimizer=OptimizerConfig(lr=1e-2), max_total_sequence_length=64,
                            resources=HALF_GPU if colocated else GPU),
        generation=GenerationConfig(backend=engine, dtype="float32", max_new_tokens=8, colocated=colocated,
                                    in_policy_workers=in_policy_workers, weight_transport=transport,
                                    refit_bucket_bytes=1 << 20,
                                    resources=HALF_GPU if colocated else GPU),
    )


ENGINES = [pytest.param("hf"), pytest.param("vllm", marks=pytest.mark.vllm)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("colocated", "transport"), [(True, "auto"), (True, "gloo"), pytest.param(
    False, "auto", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an engine on a GPU of its own needs 2 GPUs"))])
def test_train_then_sync_gives_the_trainers_logprobs(ray_cluster, tiny_model_path, engine, colocated, transport):
    if engine == "vllm":
        pytest.importorskip("vllm")
    config = _config(tiny_model_path, engine=engine, colocated=colocated, transport=transport)
    cluster = VirtualCluster(config.cluster, colocate=colocated_groups(config))
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends[engine](config, cluster)
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
        second_sync = refit(policy, generation, config.generation.refit_bucket_bytes, version=2)  # the buffer is reused
        assert second_sync.transport == stats.transport
        # NCCL refuses two ranks of one group on one GPU: a colocated engine maps rank 0's buffer
        assert stats.transport == {"gloo": "gloo", "auto": "cuda ipc" if colocated else "nccl"}[transport], stats
        assert stats.num_buckets >= 1, stats
        generation.prepare_for_generation()
        out = generation.generate(prompt_batch(PROMPTS))
        mask = generated_mask(out, PROMPTS)
        generation.finish_generation()
        policy.prepare_for_training()
        trainer = policy.get_logprobs(Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]))
        assert (out["logprobs"] - trainer["logprobs"])[mask].abs().max() < 1e-3  # bfloat16-free float32 on both sides
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


@needs_cuda
def test_engines_in_policy_workers_take_the_trained_weights_on_the_gpu(ray_cluster, tiny_model_path):
    """hf engines inside the dtensor policy's worker on its GPU: refit in memory, then the
    engine's logprobs are the trainer's."""
    with _engines_in_policy_worker(tiny_model_path) as (policy, generation):
        _check_in_process_refit(policy, generation, PROMPTS)


@contextlib.contextmanager
def _engines_in_policy_worker(model: str) -> Iterator[tuple[Any, Any]]:
    """A float32 dtensor policy on one GPU with hf engines inside its worker, shut down after."""
    config = _config(model, engine="hf", colocated=True, in_policy_workers=True)
    config = attrs.evolve(config, policy=attrs.evolve(config.policy, resources=GPU))
    cluster = VirtualCluster(config.cluster, colocate=colocated_groups(config))
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["hf"](config, cluster, host=policy)
    try:
        assert policy.info()["device"].startswith("cuda")
        yield policy, generation
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def _check_in_process_refit(policy, generation, prompts: list[list[int]]) -> None:
    stats = check_trained_policy_refit(policy, generation, prompts, bucket_bytes=1 << 20, steps=2, max_difference=1e-3)
    assert stats.transport == "in process"


@needs_cuda
@pytest.mark.vllm
def test_vllm_with_exact_logprobs_runs_batch_invariant(ray_cluster, tiny_model_path):
    """``generation.exact_logprobs`` with vLLM on a GPU is accepted and runs the engine
    batch-invariant: each row's greedy tokens and logprobs have the same bits alone and among
    fifteen other rows."""
    pytest.importorskip("vllm")
    from posttrain.config.validate import check_exact_logprobs
    from posttrain_vllm.config import validate_generation_config

    config = _config(tiny_model_path, engine="vllm", colocated=False)
    config = attrs.evolve(config, generation=attrs.evolve(config.generation, exact_logprobs=True, max_new_tokens=16))
    check_exact_logprobs(config, plugin_host())
    validate_generation_config(config)
    cluster = VirtualCluster(config.cluster)
    generation = plugin_host().generation_backends["vllm"](config, cluster)
    try:
        together = generation.generate(prompt_batch(PROMPTS * 4), greedy=True)
        for row, prompt in enumerate(PROMPTS):
            alone = generation.generate(prompt_batch([prompt]), greedy=True)
            length = int(alone["unpadded_sequence_lengths"][0])
            assert int(together["unpadded_sequence_lengths"][row]) == length
            assert torch.equal(alone["output_ids"][0, :length], together["output_ids"][row, :length])
            assert torch.equal(alone["logprobs"][0, :length], together["logprobs"][row, :length]), row
    finally:
        generation.shutdown()
        cluster.shutdown()


@needs_cuda
@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_architecture_trains_and_generates_on_a_gpu(ray_cluster, tmp_path, name):
    """Each architecture of the model zoo (its chat tokenizer and format) as a dtensor policy on
    CUDA in float32 with hf engines inside its worker: the trainer's logprobs of the engine's
    samples equal a float32 transformers forward of the checkpoint on the CPU (eager, each
    sample alone) within 1e-3, and after two training steps and the in-memory refit the engine's
    logprobs are the trainer's."""
    from posttrain.data.chat import ChatEncoder, load_tokenizer
    from posttrain.testing.policy import reference_logprobs, reference_model

    path = str(build_zoo_model(tmp_path / name, name, num_key_value_heads=2))
    encoder = ChatEncoder(load_tokenizer(path))
    chats = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "Write a poem about the sea."}]]
    prompts = [encoder.encode_prompt(chat).input_ids for chat in chats for _ in range(2)]
    with _engines_in_policy_worker(path) as (policy, generation):
        out = generation.generate(prompt_batch(prompts))
        batch = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"],
                      token_mask=generated_mask(out, prompts).float())
        trainer = policy.get_logprobs(batch)["logprobs"] * batch["token_mask"]
        with torch.no_grad():
            want = reference_logprobs(reference_model(path, torch.float32), batch)
        assert float((trainer - want).abs().max()) < 1e-3
        _check_in_process_refit(policy, generation, prompts)
