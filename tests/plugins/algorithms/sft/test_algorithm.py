"""The SFT loop end to end on the dtensor backend: learning, loss tokens, resume, export.

One uninterrupted run (module fixture) on a generated corpus: each user turn is four random
letters and the assistant answers them reversed, so every example has exactly 4 + 1 loss
tokens (the answer and ``<|end|>``; the character tokenizer has one token per letter).
"""

from __future__ import annotations

import json
import random
import string

import pytest
import torch

from posttrain.config import config_from_dict
from posttrain.data import dataset_from_config, encoder_from_config
from posttrain.errors import ConfigError
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics

ANSWER_TOKENS = 4 + 1  # four letters and <|end|>
ROWS = 8  # policy.train_global_batch_size
STEPS = 6


def write_corpus(path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choices(string.ascii_lowercase, k=4))
            messages = [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_corpus")
    return write_corpus(folder / "train.jsonl", 48, seed=1), write_corpus(folder / "val.jsonl", 12, seed=2)


def sft_config(model: str, corpus: tuple[str, str], run_dir, *overrides: str, **sft):
    """Validated like a YAML config: packing on, validation in two batches (8 + 4 rows)."""
    train, val = corpus
    tree = {
        "algorithm": "sft",
        "seed": 0,
        "run_dir": str(run_dir),
        "policy": {
            "model": model,
            "train_global_batch_size": ROWS,
            "train_micro_batch_size": 4,
            "max_total_sequence_length": 64,
            "sequence_packing": {"enabled": True, "max_tokens_per_row": 64},
            "optimizer": {"name": "adamw", "lr": 3e-3},
            "resources": {"cpus": 0.5},
        },
        "data": {"train": train, "validation": val},
        "logger": {"progress_bar": False},
        "checkpointing": {"save_period": 3},
        "sft": {"max_num_steps": STEPS, "val_period": 3, "val_at_start": True, "val_global_batch_size": 8, **sft},
    }
    return config_from_dict(tree, list(overrides))


@pytest.fixture(scope="module")
def full_run(tiny_model_path, corpus, ray_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft_full")
    config = sft_config(tiny_model_path, corpus, run_dir, export_dir=str(run_dir / "hf"))
    result = run_algorithm(config)
    return config, result, read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.ray
def test_validation_loss_falls_and_only_answer_tokens_carry_loss(full_run):
    _, result, records = full_run
    train = [r for r in records if r["phase"] == "train"]
    val = [r for r in records if r["phase"] == "validation"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in val] == [0, 3, 6]
    assert val[-1]["loss"] < val[0]["loss"] - 0.5, [r["loss"] for r in val]
    # The loss tokens the policy counted are exactly the assistant answers of the batch.
    assert {r["num_tokens"] for r in train} == {ROWS * ANSWER_TOKENS}
    for r in train:
        assert r["grad_norm"] > 0 and r["lr"] == pytest.approx(3e-3) and r["tokens_per_s"] > 0
    assert result["step"] == STEPS and result["validation/loss"] == val[-1]["loss"]


@pytest.mark.ray
def test_exported_model_reproduces_the_final_validation_loss(full_run):
    """The HF export, run by plain transformers in float64 over the validation file, gives
    the loop's last validation loss (the mean over both validation batches)."""
    from transformers import AutoModelForCausalLM

    config, _, records = full_run
    model = AutoModelForCausalLM.from_pretrained(config.section("sft").export_dir, dtype=torch.float64)
    data = dataset_from_config(config, "validation", "sft", encoder_from_config(config))
    batch = data.collate(range(len(data)))
    total, count = 0.0, 0.0
    for i, n in enumerate(batch["input_lengths"].tolist()):  # one sample at a time: no padding
        ids = batch["input_ids"][i : i + 1, :n]
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = batch["token_mask"][i, 1:n].double()
        total -= float((logp * mask).sum())
        count += float(mask.sum())
    assert count == len(data) * ANSWER_TOKENS
    final = [r for r in records if r["phase"] == "validation"][-1]["loss"]
    assert final == pytest.approx(total / count, abs=1e-5)


@pytest.mark.ray
def test_resume_continues_exactly(full_run, tiny_model_path, corpus, tmp_path):
    """Stop after step 3, run again: the second run starts at step 4 from the checkpoint and
    its metrics equal the uninterrupted run's."""
    _, _, full = full_run
    run_algorithm(sft_config(tiny_model_path, corpus, tmp_path, max_num_steps=3))
    assert (tmp_path / "checkpoints" / "step_3" / "dataloader.pt").is_file()
    run_algorithm(sft_config(tiny_model_path, corpus, tmp_path))
    records = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # steps 1-3 were not trained again
    full_train = {r["step"]: r for r in full if r["phase"] == "train"}
    for r in train:
        for name in ("loss", "grad_norm", "num_tokens"):
            assert r[name] == pytest.approx(full_train[r["step"]][name], rel=1e-6, abs=1e-7), (r["step"], name)
    full_val = [r["loss"] for r in full if r["phase"] == "validation"]
    assert [r["loss"] for r in records if r["phase"] == "validation"] == pytest.approx(full_val, rel=1e-6)


def test_config_checks_name_the_key(tiny_model_path, corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"sft\.loss: unknown loss 'nlll'.*Did you mean 'nll'"):
        sft_config(tiny_model_path, corpus, tmp_path, loss="nlll")
    with pytest.raises(ConfigError, match=r"sft\.val_period: expected 0 \(off\) or a positive step count, found -2"):
        sft_config(tiny_model_path, corpus, tmp_path, val_period=-2)
