"""``posttrain run sft|dpo --config examples/configs/...`` as a user runs them: a subprocess
from the repository root, the example data, a tiny model folder passed as an override."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.run.metrics import read_metrics

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout_s: float = 500) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": ""}  # a cluster of its own, not the test session's
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from posttrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("e2e_model"), size="tiny", seed=0))


def test_sft_example_config(model, tmp_path):
    run_dir = tmp_path / "sft"
    done = run_cli(
        "run", "sft", "--config", "examples/configs/sft.yaml", f"policy.model={model}", f"run_dir={run_dir}",
        "sft.max_num_steps=2", "sft.val_period=2", f"sft.export_dir={run_dir / 'hf'}", "logger.progress_bar=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["loss"] > 3.0  # about ln(vocabulary) for an untrained model
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", "validation")] == [2]
    assert (run_dir / "checkpoints" / "step_2" / "training_info.json").is_file()
    assert (run_dir / "hf" / "config.json").is_file()


def test_dpo_example_config(model, tmp_path):
    run_dir = tmp_path / "dpo"
    done = run_cli(
        "run", "dpo", "--config", "examples/configs/dpo.yaml", f"policy.model={model}", f"run_dir={run_dir}",
        "dpo.max_num_steps=2", "dpo.val_period=2", "logger.progress_bar=false",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts equal to the reference
    assert {"accuracy", "rewards_chosen", "rewards_rejected", "reward_margin"} <= train[1].keys()
    assert (run_dir / "checkpoints" / "step_2" / "policy").is_dir()


def test_missing_model_is_a_config_error_naming_the_key(tmp_path):
    done = run_cli("run", "sft", "--config", "examples/configs/sft.yaml", f"run_dir={tmp_path}", timeout_s=120)
    assert done.returncode == 2
    assert "config key 'policy.model' (at examples/configs/supervised_base.yaml:" in done.stderr
    assert "Missing mandatory value" in done.stderr
