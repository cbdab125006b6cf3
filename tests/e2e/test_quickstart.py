"""A shortened ``posttrain quickstart``: every stage runs for real, with fewer steps."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.ray


def test_short_quickstart_writes_its_outputs(tmp_path, ray_cluster):
    from transformers import AutoModelForCausalLM

    from posttrain.metrics import read_metrics
    from posttrain.quickstart.run import run_quickstart

    accuracies = run_quickstart(tmp_path, ["generation.backend=hf"], sft_epochs=1, grpo_steps=2)

    assert set(accuracies) == {"before SFT", "after SFT", "after GRPO"}
    assert all(0.0 <= value <= 1.0 for value in accuracies.values())
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model")
    assert model.config.num_hidden_layers == 4
    train = read_metrics(tmp_path / "grpo" / "metrics.jsonl", phase="train")
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert all(math.isfinite(v) for k, v in record.items() if isinstance(v, float))
    sft = read_metrics(tmp_path / "sft" / "metrics.jsonl", phase="validation")
    assert sft and math.isfinite(sft[-1]["loss"])
