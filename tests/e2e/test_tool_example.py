"""The worked tool-calling example (examples/tool_calculator), shortened (seed 0, its 14 SFT
epochs and 20 GRPO steps instead of 60): SFT teaches the calculator's call format, and GRPO
trains on the tool episodes, raising the sampled reward without losing what SFT taught.

How much of the copying SFT teaches depends on the seed and on the floating-point arithmetic
of the machine and of the logprob head (the model learns to copy the reply abruptly: seed 0
reached a greedy accuracy of 0.955 on one machine and at most 0.95 on another, seed 1
reached 0.18; after a change of the head's rounding, 12 epochs left 9.5% of seed 0's calls
malformed where 14 leave none), so the test checks what holds on either side of that jump;
docs/tools.md has the example's full runs, where GRPO raises the greedy accuracy too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from posttrain.run.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_calculator" / "train.py"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_sft_teaches_the_calls_and_grpo_raises_the_reward(ray_cluster, tmp_path):
    spec = importlib.util.spec_from_file_location("tool_calculator_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    result = example.train(tmp_path, seed=0, with_tool=True, sft_epochs=14, grpo_steps=20,
                           overrides=["logger.progress_bar=false"])
    metrics = tmp_path / "grpo" / "metrics.jsonl"
    validations = read_metrics(metrics, "validation")
    rewards = [record["reward"] for record in read_metrics(metrics, "train")]
    assert len(validations) == 2 and len(rewards) == 20, (validations, rewards)

    for validation in validations:  # one well-formed calculator call and an answer in 99% of the episodes or more
        calls = {name: validation[f"env/tools/{name}"] for name in ("tool_calls", "malformed_calls", "answer_rate")}
        assert calls["tool_calls"] >= 0.99 and calls["malformed_calls"] <= 0.01 and calls["answer_rate"] >= 0.99, validation
    assert result["after SFT"] >= 0.15, result  # SFT taught some of the copying: there is reward to learn from
    assert result["after GRPO"] >= result["after SFT"] - 0.03, result  # GRPO kept it
    assert _mean(rewards[-10:]) > _mean(rewards[:5]), rewards
