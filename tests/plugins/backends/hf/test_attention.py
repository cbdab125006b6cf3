"""The hf engine's attention on the CPU: grouped-query heads shared with the left-padding
mask, instead of transformers' ``sdpa`` copying the keys and values per head group, with
the same completions."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from posttrain.backend.generation_group import GenerationRequest
from posttrain.models.tiny import build_tiny_model
from posttrain_hf.attention import SHARED_KV_SDPA
from posttrain_hf.decode import decode
from posttrain_hf.worker import HFEngineWorker

#: Lengths differ: the prompts are left-padded and every step has an attention mask.
PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 30]]


@pytest.fixture(scope="module")
def gqa_model_path(tmp_path_factory):
    """Four query heads sharing two key/value heads."""
    return str(build_tiny_model(tmp_path_factory.mktemp("gqa_model"), size="tiny", seed=3, num_heads=4, num_kv_heads=2))


@pytest.fixture
def kv_copies(monkeypatch):
    """How many times transformers' ``sdpa`` copied keys or values for grouped-query heads."""
    calls = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: calls.append(n) or real(x, n))
    return calls


def _decode(model_path: str, kernel: str) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=kernel).eval()
    request = GenerationRequest(
        prompts=[list(p) for p in PROMPTS], seeds=[7, 8, 9, 10], max_new_tokens=[16] * len(PROMPTS),
        stop_strings=[[]] * len(PROMPTS), stop_token_ids=[], temperature=1.0, top_p=1.0, top_k=None,
    )
    return decode(model, request, pad_token_id=0)


def test_shared_heads_give_sdpas_completions_without_copying_the_cache(gqa_model_path, kv_copies):
    copied = _decode(gqa_model_path, "sdpa")
    copies_by_sdpa = len(kv_copies)
    shared = _decode(gqa_model_path, SHARED_KV_SDPA)

    assert copies_by_sdpa > 0 and set(kv_copies) == {2}  # sdpa copies (so the count can tell)
    assert len(kv_copies) == copies_by_sdpa  # the shared kernel copied nothing
    assert [c.token_ids for c in shared] == [c.token_ids for c in copied]
    for s, c in zip(shared, copied, strict=True):
        assert s.logprobs == pytest.approx(c.logprobs, abs=1e-6)


@pytest.mark.parametrize(("configured", "loaded"), [("sdpa", SHARED_KV_SDPA), ("eager", "eager")])
def test_the_engine_loads_sdpa_as_the_shared_heads_kernel(gqa_model_path, configured, loaded):
    engine = HFEngineWorker(model_path=gqa_model_path, dtype="float32", max_batch_size=4, attn_implementation=configured)
    assert engine.model.config._attn_implementation == loaded
