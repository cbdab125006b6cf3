"""The hf engine's attention on the CPU: grouped-query heads shared with the left-padding
mask, instead of transformers' ``sdpa`` copying the keys and values per head group, and
decoding steps given that mask ready-made, with the same completions; sliding windows and
soft-caps honoured while decoding from the cache."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.masking_utils import AttentionMaskInterface

from posttrain.backend.generation_group import GenerationRequest
from posttrain.models.tiny import build_tiny_model
from posttrain_hf.attention import SHARED_KV_SDPA, shared_kv_sdpa, takes_ready_step_masks
from posttrain_hf.decode import decode
from posttrain_hf.worker import HFEngineWorker

#: Lengths differ: the prompts are left-padded and every step has an attention mask.
PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 30]]
#: One length: no padding, so transformers' ``sdpa`` decodes without a mask.
SAME_LENGTH = [[1, 40, 41, 42], [1, 50, 51, 52], [1, 60, 61, 62], [1, 30, 31, 32]]


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


@pytest.fixture
def masks_built(monkeypatch):
    """How many masks transformers built for the shared-heads kernel (one per forward pass
    that did not get a ready-made one)."""
    calls = []
    real = AttentionMaskInterface._global_mapping[SHARED_KV_SDPA]
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, SHARED_KV_SDPA, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _decode(model_path: str, kernel: str, prompts: list[list[int]] = PROMPTS, new_tokens: int = 16) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=kernel).eval()
    request = GenerationRequest(
        prompts=[list(p) for p in prompts], seeds=[7, 8, 9, 10], max_new_tokens=[new_tokens] * len(prompts),
        stop_strings=[[]] * len(prompts), stop_token_ids=[], temperature=1.0, top_p=1.0, top_k=None,
    )
    return decode(model, request, pad_token_id=0)


def _assert_same_completions(ours: list, theirs: list) -> None:
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    for o, t in zip(ours, theirs, strict=True):
        assert o.logprobs == pytest.approx(t.logprobs, abs=1e-6)


def test_shared_heads_give_sdpas_completions_without_copying_the_cache(gqa_model_path, kv_copies):
    copied = _decode(gqa_model_path, "sdpa")
    copies_by_sdpa = len(kv_copies)
    shared = _decode(gqa_model_path, SHARED_KV_SDPA)

    assert copies_by_sdpa > 0 and set(kv_copies) == {2}  # sdpa copies (so the count can tell)
    assert len(kv_copies) == copies_by_sdpa  # the shared kernel copied nothing
    _assert_same_completions(shared, copied)


@pytest.mark.parametrize("prompts", [PROMPTS, SAME_LENGTH], ids=["padded", "same-length"])
def test_decoding_steps_take_the_mask_ready_made_with_sdpas_completions(gqa_model_path, masks_built, prompts):
    """Only the prompt's forward pass has transformers build a mask; the 15 decoding steps
    get theirs ready-made, and the completions are those of transformers' ``sdpa``, with
    left padding and without (where ``sdpa`` decodes with no mask at all)."""
    shared = _decode(gqa_model_path, SHARED_KV_SDPA, prompts)
    assert len(masks_built) == 1
    _assert_same_completions(shared, _decode(gqa_model_path, "sdpa", prompts))


def test_a_sliding_window_model_keeps_its_window_while_decoding(tmp_path, masks_built):
    """A Mistral model with a 4-token window: transformers builds every step's mask (a
    ready-made one would drop the window), and the completions are ``sdpa``'s. The same
    decode with the window dropped gives other completions, so the check can tell."""
    from transformers import MistralForCausalLM

    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path / "windowed")
    config.sliding_window = None
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path / "unwindowed")

    windowed = _decode(str(tmp_path / "windowed"), SHARED_KV_SDPA, new_tokens=12)
    assert len(masks_built) == 12  # the prompt's pass and 11 decoding steps
    _assert_same_completions(windowed, _decode(str(tmp_path / "windowed"), "sdpa", new_tokens=12))
    unwindowed = _decode(str(tmp_path / "unwindowed"), SHARED_KV_SDPA, new_tokens=12)
    assert [c.token_ids for c in unwindowed] != [c.token_ids for c in windowed]


def test_ready_step_masks_need_the_shared_kernel_and_full_attention_in_every_layer():
    def loaded(config, kernel=SHARED_KV_SDPA):
        config._attn_implementation = kernel
        return config

    assert takes_ready_step_masks(loaded(LlamaConfig()))
    assert takes_ready_step_masks(loaded(Qwen2Config(use_sliding_window=False)))
    assert not takes_ready_step_masks(loaded(LlamaConfig(), "eager"))
    assert not takes_ready_step_masks(loaded(LlamaConfig(), "sdpa"))
    assert not takes_ready_step_masks(loaded(MistralConfig(sliding_window=4096)))
    assert not takes_ready_step_masks(loaded(Qwen2Config(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2)))


@pytest.mark.parametrize("configured", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_windowed_and_soft_capped_models_report_transformers_logprobs(zoo_model, arch, configured):
    """The engine as loaded for ``generation.hf.attn_implementation``, on zoo models whose
    8-token windows bind (prompts of 2 to 12 tokens, completions of 9 to 20, rows leaving the
    batch and the cache at different budgets): every sampled token's logprob equals the one
    a float64 eager forward of prompt + completion gives, within 1e-5. Gemma 2 soft-caps
    attention scores (which SDPA cannot) and the logits the sampler draws from."""
    from transformers import AutoModelForCausalLM

    path = zoo_model(arch)
    engine = HFEngineWorker(model_path=path, dtype="float32", max_batch_size=4, attn_implementation=configured)
    prompts = [[1, *range(40, 51)], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 30]]
    budgets = [20, 14, 9, 20]
    completions = engine.generate(GenerationRequest(
        prompts=prompts, seeds=[7, 8, 9, 10], max_new_tokens=budgets, stop_strings=[[]] * 4, stop_token_ids=[],
        temperature=1.0, top_p=1.0, top_k=None,
    ))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    assert [len(c.token_ids) for c in completions] == budgets
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logprobs = reference(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        want = logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("configured", "loaded"), [("sdpa", SHARED_KV_SDPA), ("eager", "eager")])
def test_the_engine_loads_sdpa_as_the_shared_heads_kernel(gqa_model_path, configured, loaded):
    engine = HFEngineWorker(model_path=gqa_model_path, dtype="float32", max_batch_size=4, attn_implementation=configured)
    assert engine.model.config._attn_implementation == loaded


def test_soft_capped_scores_need_a_boolean_mask():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=f"{SHARED_KV_SDPA} soft-caps scores under a boolean mask, got a torch.float32 one"):
        shared_kv_sdpa(None, q, q, q, torch.zeros(1, 1, 3, 3), softcap=5.0)
