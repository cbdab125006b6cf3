"""Defaults that follow the device (docs/clusters.md#defaults-that-follow-the-device):
``dtype: auto`` of the policy and the engines (the vLLM engines' eager mode and memory share:
tests/plugins/backends/vllm/test_vllm_device_options.py)."""

from __future__ import annotations

from posttrain.config import load_config
from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources

EXAMPLE = "examples/configs/grpo_math_tiny.yaml"
AUTO = ["algorithm=grpo", "policy.dtype=auto", "generation.dtype=auto"]
#: The policy and the engines on halves of one GPU.
GPUS = ["cluster.use_gpus=true", "policy.resources.gpus=0.5", "generation.resources.gpus=0.5",
        "generation.in_policy_workers=false"]


def dtypes(*overrides: str) -> tuple[str, str]:
    config = load_config(EXAMPLE, [*AUTO, *overrides])
    return config.policy.dtype, config.generation.dtype


def test_auto_is_float32_on_cpus_and_bfloat16_on_gpus():
    assert dtypes() == ("float32", "float32")
    assert dtypes(*GPUS) == ("bfloat16", "bfloat16")
    # an engine on the CPU beside a policy on a GPU, and one inside the policy's workers on its GPU
    assert dtypes("cluster.use_gpus=true", "policy.resources.gpus=1", "generation.in_policy_workers=false") == (
        "bfloat16", "float32")
    assert dtypes("cluster.use_gpus=true", "policy.resources.gpus=1", "generation.in_policy_workers=true") == (
        "bfloat16", "bfloat16")


def test_a_lora_policy_and_a_set_dtype_are_kept(tiny_model_path):
    assert dtypes(*GPUS, "policy.lora.enabled=true", f"policy.model={tiny_model_path}") == ("float32", "bfloat16")
    assert dtypes(*GPUS, "policy.dtype=float32", "generation.dtype=float16") == ("float32", "float16")


def test_auto_is_resolved_when_the_config_is_built():
    config = RunConfig(policy=PolicyConfig(resources=WorkerResources(gpus=1)),
                       generation=GenerationConfig(resources=WorkerResources(gpus=1)))
    assert (config.policy.dtype, config.generation.dtype) == ("bfloat16", "bfloat16")
    assert (RunConfig().policy.dtype, RunConfig().generation.dtype) == ("float32", "float32")
