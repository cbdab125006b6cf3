"""A whole SFT run (validation, checkpoints, Hugging Face export) with ``policy.backend:
megatron``, chosen by name from the registry like any run: the loss falls, the exported
folder reproduces the last validation loss, and (slow) dtensor's run on the same config
logs the same numbers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.config import config_from_dict  # noqa: E402
from posttrain.run.context import run_algorithm  # noqa: E402
from posttrain.run.metrics import read_metrics  # noqa: E402
from tests.plugins.algorithms.sft.test_algorithm import write_corpus  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.ray]

STEPS = 6


def _run(backend: str, model: str, folder) -> tuple[object, list[dict]]:
    tree = {
        "algorithm": "sft",
        "seed": 0,
        "run_dir": str(folder / backend),
        "policy": {
            "backend": backend,
            "model": model,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "max_total_sequence_length": 64,
            "dynamic_batching": {"enabled": True, "max_tokens_per_microbatch": 128},
            "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
            "scheduler": {"name": "linear", "warmup_steps": 2},
            "resources": {"cpus": 0.5},
        },
        "data": {"train": write_corpus(folder / "train.jsonl", 48, 1), "validation": write_corpus(folder / "val.jsonl", 12, 2)},
        "logger": {"progress_bar": False},
        "checkpointing": {"save_period": 3},
        "sft": {"max_num_steps": STEPS, "val_period": 3, "val_at_start": True, "val_global_batch_size": 8,
                "export_dir": str(folder / backend / "hf")},
    }
    config = config_from_dict(tree, [])
    run_algorithm(config)
    return config, read_metrics(folder / backend / "metrics.jsonl")


@pytest.fixture(scope="module")
def megatron_run(tiny_model_path, ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_runs")
    return folder, _run("megatron", tiny_model_path, folder)


def test_loss_falls_and_the_export_reproduces_the_last_validation_loss(megatron_run):
    from transformers import AutoModelForCausalLM

    from posttrain.data import dataset_from_config, encoder_from_config

    _, (config, records) = megatron_run
    train = [r for r in records if r["phase"] == "train"]
    val = [r for r in records if r["phase"] == "validation"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and [r["step"] for r in val] == [0, 3, 6]
    assert val[-1]["loss"] < val[0]["loss"] - 0.5, [r["loss"] for r in val]
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
    assert val[-1]["loss"] == pytest.approx(total / count, abs=1e-5)


@pytest.mark.slow
def test_dtensor_logs_the_same_run(megatron_run, tiny_model_path):
    folder, (_, records) = megatron_run
    _, dtensor_records = _run("dtensor", tiny_model_path, folder)
    keys = ("phase", "step")
    assert [tuple(r[k] for k in keys) for r in records] == [tuple(r[k] for k in keys) for r in dtensor_records]
    for mine, theirs in zip(records, dtensor_records, strict=True):
        for name in ("loss", "grad_norm", "lr", "num_tokens"):
            if name in theirs:
                assert mine[name] == pytest.approx(theirs[name], abs=1e-4), (mine["phase"], mine["step"], name)
