"""``posttrain run`` and Ray: it stops the Ray it started, never one it found running."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_a_run_leaves_a_ray_it_did_not_start_running(ray_cluster, tiny_model_path, tmp_path, monkeypatch, capsys):
    model = Path(shutil.copytree(tiny_model_path, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))  # refused by the model check
    monkeypatch.chdir(REPO)
    code = cli.main(["run", "sft", "--config", "examples/configs/sft.yaml", f"policy.model={model}", f"run_dir={tmp_path / 'run'}"])
    assert code == 2 and "has 103 tokens" in capsys.readouterr().err
    assert ray_cluster.is_initialized()
