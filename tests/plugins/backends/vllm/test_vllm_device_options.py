"""The vLLM engines' defaults that follow the device (docs/clusters.md#defaults-that-follow-the-device):
eager on CPUs and compiled with CUDA graphs on GPUs; the share of GPU memory by placement."""

from __future__ import annotations

import pytest

from posttrain.config import load_config
from posttrain_vllm.config import COLOCATED_GPU_MEMORY, OWN_GPU_MEMORY, SECTION, VllmGenerationConfig, device_options
from tests.core.test_device_defaults import EXAMPLE, GPUS


@pytest.mark.parametrize(("overrides", "want"), [
    ([], {"enforce_eager": True, "gpu_memory_utilization": COLOCATED_GPU_MEMORY}),
    (GPUS + ["generation.colocated=true"], {"enforce_eager": False, "gpu_memory_utilization": COLOCATED_GPU_MEMORY}),
    (GPUS[:2] + ["generation.resources.gpus=1", "generation.colocated=false"],
     {"enforce_eager": False, "gpu_memory_utilization": OWN_GPU_MEMORY}),
    (GPUS + ["generation.vllm.enforce_eager=true", "generation.vllm.gpu_memory_utilization=0.3"],
     {"enforce_eager": True, "gpu_memory_utilization": 0.3}),
])
def test_vllm_engines_compile_and_take_memory_by_placement(overrides, want):
    config = load_config(EXAMPLE, ["algorithm=grpo", "generation.backend=vllm", *overrides])
    assert device_options(config, config.sections.get(SECTION) or VllmGenerationConfig()) == want
