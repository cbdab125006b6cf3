"""GRPO on a mixture of two tasks: arithmetic (math) and a number-guessing game
(guess_number), each source with its own task and weight. Every step's samples are counted per
source and sum to the step's; each source reports its reward and lengths, in training and in
validation (a list of validation sources)."""

from __future__ import annotations

import pytest

from posttrain.config.schema import DataConfig, DataSource
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_env_math.guess_number import guess_number_prompt
from posttrain_grpo.config import GRPOConfig
from tests.e2e.test_grpo_e2e import make_config, write_rows

pytestmark = pytest.mark.ray


def sums(count: int, offset: int = 0) -> list[dict]:
    """Prompts without a task (their source gives it): answer 7."""
    return [{"messages": [{"role": "user", "content": f"Say seven. ({offset + i})"}], "answer": "7"} for i in range(count)]


def games(count: int) -> list[dict]:
    return [{"messages": guess_number_prompt(1, 5), "metadata": {"target": 1 + i % 5, "low": 1, "high": 5}}
            for i in range(count)]


def test_grpo_on_two_tasks_logs_each_sources_samples_and_reward(ray_cluster, tiny_model_path, tmp_path):
    train = [DataSource(path=write_rows(tmp_path / "sums.jsonl", sums(12)), task="math", weight=3.0),
             DataSource(path=write_rows(tmp_path / "games.jsonl", games(6)), task="guess_number", weight=1.0,
                        tag="game")]
    validation = [DataSource(path=write_rows(tmp_path / "sums_val.jsonl", sums(2, offset=100)), task="math", tag="sums"),
                  DataSource(path=write_rows(tmp_path / "games_val.jsonl", games(2)), task="guess_number", tag="game")]
    grpo = GRPOConfig(num_prompts_per_step=4, num_generations_per_prompt=2, max_num_steps=2, max_rollout_turns=2,
                      val_period=2)
    config = make_config(tiny_model_path, tmp_path / "run", "unused", grpo,
                         data=DataConfig(train=train, validation=validation, seed=5),
                         environments={"math": {}, "guess_number": {"max_guesses": 2}})
    config.policy.max_total_sequence_length = 256
    run_algorithm(config)

    metrics = tmp_path / "run" / "metrics.jsonl"
    train_records = read_metrics(metrics, "train")
    assert [r["step"] for r in train_records] == [1, 2]
    drawn = {"sums": 0.0, "game": 0.0}
    for record in train_records:
        counts = {tag: record.get(f"data/{tag}/samples", 0.0) for tag in drawn}
        assert sum(counts.values()) == 8.0, record  # 4 prompts x 2 generations, each from one source
        for tag, count in counts.items():
            drawn[tag] += count
            if count:
                assert 0.0 <= record[f"data/{tag}/mean_reward"] <= 1.0 and record[f"data/{tag}/mean_generated_tokens"] > 0
        if counts["game"]:
            assert record["env/guess_number/mean_guesses"] >= 1.0
    assert drawn["sums"] > 0 and drawn["game"] > 0, drawn

    (validation_record,) = read_metrics(metrics, "validation")
    assert validation_record["data/sums/samples"] == validation_record["data/game/samples"] == 2.0
    both = (2 * validation_record["data/sums/mean_reward"] + 2 * validation_record["data/game/mean_reward"]) / 4
    assert validation_record["accuracy"] == pytest.approx(both)
