"""SFT through ``run_algorithm`` on the torch backend: it learns, follows the schedule, and
its Hugging Face export reproduces the run's last validation loss in plain transformers.

The corpus: each user turn is four random letters and the assistant answers them reversed,
so every example has exactly 4 + 1 loss tokens (the answer and ``<|end|>``; the tiny
model's tokenizer has one token per letter).
"""

from __future__ import annotations

import json
import random
import string

import pytest
import torch

from posttrain.backend.lr_schedule import lr_factor
from posttrain.config import SchedulerConfig, config_from_dict
from posttrain.data import dataset_from_config, encoder_from_config
from posttrain.models.tiny import build_tiny_model
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics

pytest_plugins = ["posttrain.testing.pytest_plugin"]

ANSWER_TOKENS = 4 + 1
ROWS = 8  # policy.train_global_batch_size
STEPS = 6
LR = 3e-3
SCHEDULE = {"name": "linear", "warmup_steps": 2, "min_lr_ratio": 0.1}


def write_corpus(path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choices(string.ascii_lowercase, k=4))
            messages = [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def run(ray_local, tmp_path_factory):
    """One SFT run: packed microbatches (run by the backend as padded rows), AdamW, a
    linear schedule with warmup, clipping at the default policy.max_grad_norm."""
    folder = tmp_path_factory.mktemp("torch_sft")
    model = str(build_tiny_model(folder / "model", size="tiny", seed=0))
    tree = {
        "algorithm": "sft",
        "seed": 0,
        "run_dir": str(folder / "run"),
        "policy": {
            "backend": "torch",
            "model": model,
            "train_global_batch_size": ROWS,
            "train_micro_batch_size": 4,
            "max_total_sequence_length": 64,
            "sequence_packing": {"enabled": True, "max_tokens_per_row": 64},
            "optimizer": {"name": "adamw", "lr": LR},
            "scheduler": SCHEDULE,
            "resources": {"cpus": 0.5},
        },
        "data": {
            "train": write_corpus(folder / "train.jsonl", 48, seed=1),
            "validation": write_corpus(folder / "val.jsonl", 12, seed=2),
        },
        "logger": {"progress_bar": False},
        "checkpointing": {"enabled": False},
        "sft": {"max_num_steps": STEPS, "val_period": 3, "val_at_start": True, "val_global_batch_size": 8,
                "export_dir": str(folder / "hf")},
    }
    config = config_from_dict(tree)
    run_algorithm(config)
    return config, read_metrics(folder / "run" / "metrics.jsonl")


@pytest.mark.ray
def test_the_loss_falls_on_the_answer_tokens_with_the_scheduled_lr(run):
    _, records = run
    train = [r for r in records if r["phase"] == "train"]
    val = [r for r in records if r["phase"] == "validation"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in val] == [0, 3, 6]
    assert val[-1]["loss"] < val[0]["loss"] - 0.5, [r["loss"] for r in val]
    assert {r["num_tokens"] for r in train} == {ROWS * ANSWER_TOKENS}  # only the answers carry loss
    schedule = SchedulerConfig(**SCHEDULE, total_steps=STEPS)  # the run's optimizer steps are the horizon
    assert [r["lr"] for r in train] == pytest.approx([LR * lr_factor(s, schedule) for s in range(STEPS)], rel=1e-6)
    assert all(r["grad_norm"] > 0 for r in train)


@pytest.mark.ray
def test_the_exported_model_loads_and_gives_the_last_validation_loss(run):
    """transformers, in float64, over the validation file, one sample at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    config, records = run
    model = AutoModelForCausalLM.from_pretrained(config.section("sft").export_dir, dtype=torch.float64)
    data = dataset_from_config(config, "validation", "sft", encoder_from_config(config))
    batch = data.collate(range(len(data)))
    total, count = 0.0, 0.0
    for i, n in enumerate(batch["input_lengths"].tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = batch["token_mask"][i, 1:n].double()
        total -= float((logp * mask).sum())
        count += float(mask.sum())
    assert count == len(data) * ANSWER_TOKENS
    last = [r for r in records if r["phase"] == "validation"][-1]["loss"]
    assert last == pytest.approx(total / count, abs=1e-5)
