"""The Hugging Face export of a trained mixture-of-experts policy holds the checkpoint's
names (what ``save_pretrained`` writes: per-expert matrices, Mixtral's ``block_sparse_moe``),
not transformers 5's packed in-memory ones, so that vLLM loads it; vLLM and transformers then
give the trained policy's logprobs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import GenerationConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.testing.generation import NegativeLogLikelihood, generated_mask, prompt_batch
from posttrain.testing.zoo import build_zoo_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable"),
]

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]


def saved_names(folder) -> set[str]:
    return set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_a_trained_moe_export_loads_in_vllm_and_transformers_with_the_policys_logprobs(ray_cluster, tmp_path, architecture):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    original = build_zoo_model(tmp_path / "zoo", architecture)
    with safe_open(str(original / "model.safetensors"), "pt") as f:
        checkpoint_names = set(f.keys())
    config = RunConfig(
        seed=3,
        policy=PolicyConfig(model=str(original), max_total_sequence_length=64, train_global_batch_size=len(PROMPTS),
                            train_micro_batch_size=len(PROMPTS), optimizer=OptimizerConfig(lr=3e-2),
                            resources=WorkerResources(cpus=1)),
    )
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    try:
        batch = prompt_batch(PROMPTS)
        batch["token_mask"] = (torch.arange(batch["input_ids"].shape[1]) < batch["input_lengths"][:, None]).float()
        batch["sample_mask"] = torch.ones(len(PROMPTS))
        policy.train(batch, NegativeLogLikelihood())
        export = tmp_path / "export"
        policy.export_hf(str(export))
        assert saved_names(export) == checkpoint_names  # every name as save_pretrained writes it, no packed ones

        served = RunConfig(seed=3, policy=config.policy, generation=GenerationConfig(
            backend="vllm", model=str(export), temperature=1.0, max_new_tokens=12, resources=WorkerResources(cpus=1)))
        generation = plugin_host().generation_backends["vllm"](served, cluster)
        try:
            out = generation.generate(prompt_batch(PROMPTS))
        finally:
            generation.shutdown()
        rows = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        trained = policy.get_logprobs(rows)["logprobs"]
    finally:
        policy.shutdown()
    mask = generated_mask(out, PROMPTS)
    assert float((out["logprobs"] - trained)[mask].abs().max()) <= 1e-4

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        for row, length in enumerate(out["unpadded_sequence_lengths"].tolist()):
            tokens = out["output_ids"][row : row + 1, :length]
            logprobs = model(input_ids=tokens).logits[0, :-1].log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0]
            torch.testing.assert_close(logprobs, trained[row, 1:length], rtol=0, atol=1e-5)
