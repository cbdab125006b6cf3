"""Two data-parallel ``hf`` engines: rows are split over them and come back in order, each
sampled exactly as one in-process decode of the whole batch samples it (per-row seeds)."""

from __future__ import annotations

import pytest
import torch

from posttrain.backend.generation_group import GenerationRequest
from posttrain.backend.sampling import sample_seeds
from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.plugins import plugin_host
from posttrain.testing.generation import check_output_layout, generated_tokens, prompt_batch
from posttrain_hf.decode import decode

pytestmark = pytest.mark.ray

PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8], [1, 12], [1, 13, 14, 15, 16]]  # 3 + 2 rows


def test_two_engines_match_one_in_process_decode(ray_cluster, tiny_model_path):
    from transformers import AutoModelForCausalLM

    config = RunConfig(
        seed=11,
        policy=PolicyConfig(model=tiny_model_path),
        generation=GenerationConfig(
            backend="hf", num_workers=2, temperature=0.9, top_k=20, max_new_tokens=10, resources=WorkerResources(cpus=1)
        ),
    )
    generation = plugin_host().generation_backends["hf"](config, VirtualCluster(config.cluster))
    try:
        outputs = [generation.generate(prompt_batch(PROMPTS)) for _ in range(2)]
    finally:
        generation.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for call, out in enumerate(outputs):
        check_output_layout(out, PROMPTS, pad_token_id=0)
        request = GenerationRequest(
            prompts=PROMPTS, seeds=sample_seeds(11, call, len(PROMPTS)), max_new_tokens=[10] * len(PROMPTS),
            stop_strings=[[] for _ in PROMPTS], stop_token_ids=[2], temperature=0.9, top_p=1.0, top_k=20,
        )
        expected = decode(model, request, pad_token_id=0)
        assert generated_tokens(out, PROMPTS) == [c.token_ids for c in expected]
        assert out["truncated"].tolist() == [c.truncated for c in expected]
    assert generated_tokens(outputs[0], PROMPTS) != generated_tokens(outputs[1], PROMPTS)
