"""Helpers for algorithm tests: an in-memory tiny model and its logprobs in posttrain's convention."""

from __future__ import annotations

import pytest
import torch


def build_tiny_lm(seed: int):
    """A seeded tiny Llama in memory (the same architecture as ``posttrain.models.tiny``), eval mode."""
    from transformers import LlamaForCausalLM

    from posttrain.models.tiny import build_tokenizer, tiny_llama_config

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(len(build_tokenizer())))
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def token_logprobs(model, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """float32 [B, S]: ``log p(x_t | x_<t)`` at ``1 <= t < length``, 0 at t = 0 and on padding."""
    valid = torch.arange(input_ids.shape[1])[None, :] < input_lengths[:, None]
    logits = model(input_ids=input_ids, attention_mask=valid.long()).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = picked
    return out * valid


@pytest.fixture(scope="session")
def tiny_lm():
    """``tiny_lm(seed)``: a fresh seeded tiny model (no files, well under a second)."""
    return build_tiny_lm


@pytest.fixture(scope="session")
def hf_logprobs():
    """``hf_logprobs(model, batch)``: the batch's token logprobs under a Hugging Face model."""
    return lambda model, batch: token_logprobs(model, batch["input_ids"], batch["input_lengths"])


def _turn(role: str, content: str) -> list[dict[str, str]]:
    return [{"role": role, "content": content}]


@pytest.fixture
def preference_rows() -> list[dict]:
    """Three preference rows in conversational form (one with a system turn), as the DPO and
    reward-model parity tests give both posttrain and TRL."""
    return [
        {"prompt": _turn("user", "2+2"), "chosen": _turn("assistant", "4"), "rejected": _turn("assistant", "five")},
        {"prompt": _turn("user", "sky?"), "chosen": _turn("assistant", "blue"),
         "rejected": _turn("assistant", "green, surely")},
        {"prompt": [{"role": "system", "content": "terse"}, *_turn("user", "hello")],
         "chosen": _turn("assistant", "hi"), "rejected": _turn("assistant", "greetings to you")},
    ]
