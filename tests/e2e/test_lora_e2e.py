"""SFT and DPO runs with ``policy.lora`` on the dtensor backend, config to export.

- SFT (answer a 4-letter word reversed): the validation loss falls; the export is a PEFT folder
  whose adapters, loaded with peft, give the run's last validation loss, and its ``merged/``
  model gives it too;
- DPO: the reference is the base model with the adapters off, so the first step's loss is
  ln 2 exactly, and the preference is learnt through the adapters alone.

GRPO with LoRA: ``test_quickstart.py`` (the quickstart task's accuracy rises).
"""

from __future__ import annotations

import json
import math
import random
import string

import pytest
import torch

from posttrain.config import config_from_dict
from posttrain.data import dataset_from_config, encoder_from_config
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics

pytestmark = pytest.mark.ray

LORA = {"enabled": True, "rank": 8, "alpha": 16.0, "export_merged": True}


def write_rows(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def reversal(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=4)) for _ in range(n)]
    return [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]} for w in words]


def mean_nll(model, batch) -> float:
    """The mean token NLL of ``batch`` under a Hugging Face (or peft) model, sample by sample."""
    total, count = 0.0, 0.0
    for i, n in enumerate(batch["input_lengths"].tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].double().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = batch["token_mask"][i, 1:n].double()
        total -= float((logp * mask).sum())
        count += float(mask.sum())
    return total / count


def test_lora_sft_learns_and_exports_a_peft_folder(tiny_model_path, ray_cluster, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    config = config_from_dict({
        "algorithm": "sft", "seed": 0, "run_dir": str(run_dir),
        "policy": {"model": tiny_model_path, "train_global_batch_size": 8, "train_micro_batch_size": 8,
                   "max_total_sequence_length": 64, "optimizer": {"name": "adamw", "lr": 5e-3}, "lora": LORA,
                   "resources": {"cpus": 0.5}},
        "data": {"train": write_rows(tmp_path / "train.jsonl", reversal(48, seed=1)),
                 "validation": write_rows(tmp_path / "val.jsonl", reversal(8, seed=2))},
        "logger": {"progress_bar": False},
        "checkpointing": {"save_period": 6},
        "sft": {"max_num_steps": 6, "val_period": 6, "val_at_start": True, "export_dir": str(tmp_path / "export")},
    })
    run_algorithm(config)

    val = read_metrics(run_dir / "metrics.jsonl", "validation")
    # a random tiny model with its embeddings frozen learns slowly through adapters (measured: 4.614 -> 4.421)
    assert [r["step"] for r in val] == [0, 6] and val[-1]["loss"] < val[0]["loss"] - 0.1, val
    assert (run_dir / "checkpoints" / "step_6" / "policy").is_dir()  # its contents: tests/plugins/backends/dtensor

    data = dataset_from_config(config, "validation", "sft", encoder_from_config(config))
    batch = data.collate(range(len(data)))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "export")).double()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "merged", dtype=torch.float64)
    assert mean_nll(adapted, batch) == pytest.approx(val[-1]["loss"], rel=1e-5)
    assert mean_nll(merged, batch) == pytest.approx(val[-1]["loss"], rel=1e-5)


def test_lora_dpo_starts_at_ln2_and_learns_the_preference(tiny_model_path, ray_cluster, tmp_path):
    rng = random.Random(1)
    pairs = [{"prompt": "".join(rng.choices(string.ascii_lowercase, k=4)), "chosen": "yes", "rejected": "no"}
             for _ in range(32)]
    run_dir = tmp_path / "run"
    run_algorithm(config_from_dict({
        "algorithm": "dpo", "seed": 0, "run_dir": str(run_dir),
        "policy": {"model": tiny_model_path, "train_global_batch_size": 8, "train_micro_batch_size": 8,
                   "max_total_sequence_length": 32, "optimizer": {"name": "adamw", "lr": 2e-2}, "lora": LORA,
                   "resources": {"cpus": 0.5}},
        "data": {"train": write_rows(tmp_path / "train.jsonl", pairs)},
        "logger": {"progress_bar": False},
        "checkpointing": {"enabled": False},
        "dpo": {"beta": 0.1, "max_num_steps": 8, "val_period": 0},
    }))
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and abs(train[0]["reward_margin"]) < 1e-6
    # measured: accuracy 1.0, margin 0.32, loss 0.55 at step 8
    assert train[-1]["accuracy"] == 1.0 and train[-1]["reward_margin"] > 0.2 and train[-1]["loss"] < 0.6, train[-1]
