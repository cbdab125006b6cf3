"""Whole reward-model runs on CPU (the dtensor policy with a value head, the tiny model): on
a learnable synthetic preference set the held-out accuracy rises; the exported folder loads
with ``AutoModelForSequenceClassification`` and gives the trainer's scores; GRPO with the
``reward_model`` environment scoring with it raises that reward; preference rows without a
side are refused naming the file and the line."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
import torch

from posttrain.config import config_from_dict
from posttrain.data import ChatEncoder, build_dataset
from posttrain.errors import DataError
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics

PAIRS, VAL_PAIRS = 64, 16


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preference_rows(count: int, seed: int) -> list[dict]:
    """Digits are preferred to letters, whatever the prompt: learnable from the completions alone."""
    rng = random.Random(seed)

    def word(alphabet: str) -> str:
        return "".join(rng.choices(alphabet, k=rng.randint(2, 5)))

    return [{"prompt": f"Say something ({i})", "chosen": word(string.digits), "rejected": word(string.ascii_letters)}
            for i in range(count)]


def rm_config(model: str, run_dir: Path, train: Path, validation: Path, export: Path):
    return config_from_dict({
        "algorithm": "rm", "seed": 0, "run_dir": str(run_dir),
        "policy": {"model": model, "train_global_batch_size": 16, "train_micro_batch_size": 8,
                   "logprob_micro_batch_size": 8, "max_total_sequence_length": 64, "optimizer": {"lr": 3e-3},
                   "sequence_packing": {"enabled": True, "max_tokens_per_row": 128}},  # scores from packed rows
        "data": {"train": str(train), "validation": str(validation)},
        "rm": {"max_num_epochs": 3, "val_at_start": True, "export_dir": str(export)},
        "checkpointing": {"enabled": False}, "logger": {"progress_bar": False},
    })


@pytest.fixture(scope="module")
def trained(ray_cluster, tiny_model_path, tmp_path_factory):
    """A reward model trained on the synthetic pairs: (run folder, exported folder, validation file)."""
    root = tmp_path_factory.mktemp("rm")
    train = write_rows(root / "train.jsonl", preference_rows(PAIRS, seed=0))
    validation = write_rows(root / "val.jsonl", preference_rows(VAL_PAIRS, seed=1))
    run_algorithm(rm_config(tiny_model_path, root / "run", train, validation, root / "rm_model"))
    return root / "run", root / "rm_model", validation


def test_held_out_accuracy_rises(trained):
    run_dir, _, _ = trained
    validation = read_metrics(run_dir / "metrics.jsonl", "validation")
    assert [r["step"] for r in validation] == [0, 24]
    before, after = validation[0], validation[-1]
    assert before["accuracy"] <= 0.75, before  # an untrained head ranks pairs about at random
    assert after["accuracy"] >= 0.9 and after["margin"] > before["margin"] + 1.0, after
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.3


def test_the_exported_folder_gives_the_trainers_scores(trained, tiny_model_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run_dir, export, validation = trained
    model = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    batch = build_dataset(validation, "preference", ChatEncoder(AutoTokenizer.from_pretrained(export))).collate(
        range(VAL_PAIRS))
    with torch.no_grad():
        valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
        scores = model(input_ids=batch["input_ids"], attention_mask=valid.long()).logits[:, 0]
    chosen, rejected = scores[0::2], scores[1::2]
    logged = read_metrics(run_dir / "metrics.jsonl", "validation")[-1]  # the trainer's, on the same pairs
    assert float(chosen.mean()) == pytest.approx(logged["rewards_chosen"], rel=1e-4, abs=1e-5)
    assert float(rejected.mean()) == pytest.approx(logged["rewards_rejected"], rel=1e-4, abs=1e-5)
    assert float((chosen > rejected).float().mean()) == pytest.approx(logged["accuracy"])
    assert float(torch.nn.functional.softplus(rejected - chosen).mean()) == pytest.approx(logged["loss"], rel=1e-4)


def test_grpo_with_the_reward_model_environment_raises_its_reward(trained, tiny_model_path, tmp_path):
    _, export, _ = trained
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": f"Say something ({i})"} for i in range(64)])
    config = config_from_dict({
        "algorithm": "grpo", "seed": 3, "run_dir": str(tmp_path / "grpo"),
        "policy": {"model": tiny_model_path, "train_global_batch_size": 32, "train_micro_batch_size": 32,
                   "logprob_micro_batch_size": 32, "max_total_sequence_length": 64, "optimizer": {"lr": 3e-3}},
        "generation": {"max_new_tokens": 4},
        "data": {"train": str(prompts)},
        "environments": {"reward_model": {"model": str(export)}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": 12},
        "checkpointing": {"enabled": False}, "logger": {"progress_bar": False},
    })
    run_algorithm(config)
    rewards = [r["reward"] for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl", "train")]
    assert len(rewards) == 12
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 1.0, rewards


def test_preference_rows_without_a_side_are_refused_naming_the_file_and_line(tiny_model_path, tmp_path):
    rows = preference_rows(4, seed=0)
    del rows[2]["rejected"]
    train = write_rows(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as info:
        run_algorithm(rm_config(tiny_model_path, tmp_path / "run", train, train, tmp_path / "export"))
    assert str(info.value) == (
        f"{train} row 3: missing key 'rejected' (preference rows need 'prompt', 'chosen', 'rejected'; 'prompt' may "
        "be left out when chosen and rejected are whole conversations)"
    )
