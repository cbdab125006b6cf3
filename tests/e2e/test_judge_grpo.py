"""GRPO scored by the ``judge`` environment: a tiny local judge model, in its own actor, gives
each response the probability that its verdict starts with "y". The run completes, and every
step's rewards are the judge's probabilities (in (0, 1), different between samples)."""

from __future__ import annotations

import pytest

from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_grpo.config import GRPOConfig
from tests.e2e.test_grpo_e2e import make_config, write_rows

pytestmark = pytest.mark.ray


def test_grpo_with_a_judge_model_completes(ray_cluster, tiny_model_path, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1), "task": "judge"}
            for i in range(8)]
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2)
    judge = {"model": tiny_model_path, "prompt": "Q {question} R {response} A {reference} ok?",
             "verdict": "token_probability", "labels": {"y": 1.0, "n": 0.0}}
    config = make_config(tiny_model_path, tmp_path / "run", write_rows(tmp_path / "train.jsonl", rows), grpo,
                         environments={"judge": judge})
    run_algorithm(config)

    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 < record["env/judge/mean_score"] < 1.0
        assert record["env/judge/mean_score"] == pytest.approx(record["rollout/mean_reward"])
        assert record["env/judge/unparsable"] == record["env/judge/request_errors"] == 0.0
        assert record["grad_norm"] > 0  # rewards differ within each group: the judge's scores are continuous
