"""The test zoo: every architecture builds, reloads bit for bit, and its distinctive feature
changes the numbers at the zoo's size (so a path that ignores it fails a parity test)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.testing.zoo import ARCHITECTURES, build_zoo_model, zoo_config

TOKENS = torch.randint(7, 100, (2, 24), generator=torch.Generator().manual_seed(0))


def loss_of(model) -> float:
    with torch.no_grad():
        return float(model(TOKENS, labels=TOKENS).loss)


def eager(config, seed: int = 0):
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architecture_builds_and_reloads(tmp_path, name):
    path = build_zoo_model(tmp_path / name, name, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.model_type == zoo_config(name).model_type
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert loss_of(model) == loss_of(eager(zoo_config(name), seed=3))


@pytest.mark.parametrize(
    ("name", "without"),
    [
        ("mistral", {"sliding_window": None}),
        ("gemma2", {"sliding_window": 4096}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma3", {"sliding_window": 4096}),
        ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    ],
    ids=["mistral_window", "gemma2_window", "gemma2_attn_cap", "gemma2_final_cap", "gemma3_window", "llama3_rope"],
)
def test_distinctive_features_change_the_loss(name, without):
    with_feature, without_feature = loss_of(eager(zoo_config(name))), loss_of(eager(zoo_config(name, **without)))
    assert abs(with_feature - without_feature) > 1e-4, (with_feature, without_feature)


def test_tied_architectures_tie():
    for name in ("llama_tied", "qwen2", "qwen3", "gemma2", "gemma3"):
        model = eager(zoo_config(name))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), name


def test_unknown_architecture_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown zoo architecture 'gemma9'; known: llama, llama3"):
        zoo_config("gemma9")
