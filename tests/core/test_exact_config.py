"""``generation.exact_logprobs`` is refused, when the config loads and before Ray starts, with
every backend or setting that would break it: each message names the key, what it is, the
fix, and where it was set."""

from __future__ import annotations

import pytest

from posttrain.config import load_config
from posttrain.config.exact import rollout_logprobs_are_the_trainers
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host

EXACT = "generation:\n  exact_logprobs: true\n"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            "policy:\n  backend: megatron\n" + EXACT,
            "generation.exact_logprobs is true, but the policy backend 'megatron' (posttrain-megatron 0.1.0) cannot score "
            "tokens as the engines do; backends that can: dtensor. Set policy.backend to one of them, or "
            "generation.exact_logprobs: false. Where set: generation.exact_logprobs at exp.yaml:4; policy.backend at "
            "exp.yaml:2.",
        ),
        (
            EXACT + "  dtype: bfloat16\n",
            "generation.exact_logprobs is true, but generation.dtype is bfloat16 and policy.dtype float32: the two "
            "sides must compute in one dtype; set both to the same. Where set: generation.exact_logprobs at "
            "exp.yaml:2; generation.dtype at exp.yaml:3.",
        ),
        (
            EXACT + "  top_p: 0.9\n",
            "generation.exact_logprobs is true, but generation.top_k is None and generation.top_p 0.9: the engines "
            "would report logprobs of the filtered distribution, the trainer computes the full softmax; set "
            "generation.top_k: null and generation.top_p: 1.0. Where set: generation.exact_logprobs at exp.yaml:2; "
            "generation.top_p at exp.yaml:3.",
        ),
        (
            EXACT + "policy:\n  num_workers: 2\n  tensor_parallel_size: 2\n",
            "generation.exact_logprobs is true, but policy.tensor_parallel_size is 2: model parallelism splits the "
            "sums of the policy's products over devices, which the engines do not; set policy.tensor_parallel_size: "
            "1 (data parallelism keeps them whole). Where set: generation.exact_logprobs at exp.yaml:2; "
            "policy.tensor_parallel_size at exp.yaml:5.",
        ),
        (
            "cluster:\n  use_gpus: true\n  num_gpus: 1\npolicy:\n  resources:\n    gpus: 1\n" + EXACT,
            "generation.exact_logprobs is true, but cluster.use_gpus is true: exact logprobs are bit for bit on "
            "CPUs, where the kernels give a row the same bits in any batch; GPU libraries choose kernels by the shape "
            "of the whole product. On GPUs use generation.backend: vllm, which runs batch-invariant kernels. Where "
            "set: generation.exact_logprobs at exp.yaml:8; cluster.use_gpus at exp.yaml:2.",
        ),
        (
            EXACT + "  hf:\n    attn_implementation: eager\n",
            "generation.exact_logprobs is true, but generation.hf.attn_implementation is 'eager': the engines rescore "
            "their samples with the policy's sdpa arithmetic; set generation.hf.attn_implementation: sdpa. Where set: "
            "generation.exact_logprobs at exp.yaml:2; generation.hf.attn_implementation at exp.yaml:4.",
        ),
        (
            EXACT + "policy:\n  dtensor:\n    attn_implementation: eager\n",
            "generation.exact_logprobs is true, but policy.dtensor.attn_implementation is 'eager'; exact logprobs run "
            "attention as sdpa segments: set policy.dtensor.attn_implementation: sdpa. Where set: "
            "generation.exact_logprobs at exp.yaml:2; policy.dtensor.attn_implementation at exp.yaml:5.",
        ),
    ],
    ids=["megatron", "two-dtypes", "top-p", "tensor-parallel", "gpus", "hf-eager", "dtensor-eager"],
)
def test_settings_that_break_exact_logprobs_are_refused(yaml_file, yaml, message):
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file(yaml))
    assert str(info.value) == message


def test_lora_with_dropout_is_refused(yaml_file, tiny_model_path):
    yaml = EXACT + f"policy:\n  model: {tiny_model_path}\n  lora:\n    enabled: true\n    dropout: 0.1\n"
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file(yaml))
    assert str(info.value) == (
        "generation.exact_logprobs is true, but policy.lora.dropout is 0.1: training's forward would not be the "
        "engines'; set policy.lora.dropout: 0. Where set: generation.exact_logprobs at exp.yaml:2; policy.lora.dropout "
        "at exp.yaml:7."
    )


def test_lora_in_bfloat16_is_refused(yaml_file, tiny_model_path):
    yaml = EXACT + f"  dtype: bfloat16\npolicy:\n  model: {tiny_model_path}\n  dtype: bfloat16\n  lora:\n    enabled: true\n"
    with pytest.raises(ConfigError, match=r"policy.lora is on with policy.dtype bfloat16: the merged weight a refit "
                                          r"sends is computed in float32"):
        load_config(yaml_file(yaml))


def test_hf_with_dtensor_on_cpus_is_exact(yaml_file, tiny_model_path):
    config = load_config(yaml_file(EXACT + f"policy:\n  model: {tiny_model_path}\n"))
    assert rollout_logprobs_are_the_trainers(config, plugin_host())
    plain = load_config(yaml_file(f"policy:\n  model: {tiny_model_path}\n"))
    assert not rollout_logprobs_are_the_trainers(plain, plugin_host())


VLLM_ON_GPUS = ("cluster:\n  use_gpus: true\n  num_gpus: 2\npolicy:\n  resources:\n    gpus: 1\n"
                "generation:\n  backend: vllm\n  colocated: false\n  exact_logprobs: true\n  resources:\n    gpus: 1\n")


@pytest.mark.vllm
def test_vllm_runs_batch_invariant_on_gpus_and_is_refused_on_cpus(yaml_file):
    pytest.importorskip("vllm")
    config = load_config(yaml_file(VLLM_ON_GPUS))
    assert config.generation.exact_logprobs and not rollout_logprobs_are_the_trainers(config, plugin_host())
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file("generation:\n  backend: vllm\n  exact_logprobs: true\n"))
    assert str(info.value).startswith(
        "generation.exact_logprobs is true with generation.backend vllm on CPUs: vLLM-CPU computes with kernels of its own"
    )
    assert str(info.value).endswith(
        "set generation.backend: hf, whose logprobs are the trainer's bit for bit. Where set: generation.exact_logprobs "
        "at exp.yaml:3; generation.backend at exp.yaml:2."
    )


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("  vllm:\n    engine_kwargs:\n      attention_backend: FLASHINFER\n",
         "generation.exact_logprobs is true, but generation.vllm.engine_kwargs chooses the attention backend FLASHINFER, "
         "which vLLM's batch-invariant mode does not support; choose one of FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, "
         "FLASH_ATTN_MLA, TRITON_MLA, or leave it to vLLM."),
        ("    env_vars:\n      VLLM_BATCH_INVARIANT: '0'\n",
         "generation.exact_logprobs is true, but generation.resources.env_vars sets VLLM_BATCH_INVARIANT=0; the option "
         "turns vLLM's batch-invariant mode on (VLLM_BATCH_INVARIANT=1): leave it out."),
    ],
    ids=["attention-backend", "environment"],
)
def test_vllm_settings_that_break_batch_invariance_are_refused(yaml_file, extra, message):
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file(VLLM_ON_GPUS + extra))
    assert str(info.value).startswith(message)
