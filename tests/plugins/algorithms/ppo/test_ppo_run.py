"""A whole PPO run on CPU (dtensor policy and critic, hf generation, the tiny model) on the
task the GRPO tests learn by RL alone (answer 7, scored by the math environment): the reward
rises; the critic's values follow the returns, and it is checkpointed beside the policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import config_from_dict
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics

pytestmark = pytest.mark.ray


def test_reward_rises_and_the_critic_learns(ray_cluster, tiny_model_path, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Say seven. ({i})"}], "answer": "7", "task": "math"}
            for i in range(80)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = config_from_dict({
        "algorithm": "ppo", "seed": 3, "run_dir": str(tmp_path / "run"),
        "policy": {"model": tiny_model_path, "train_global_batch_size": 32, "train_micro_batch_size": 32,
                   "logprob_micro_batch_size": 32, "max_total_sequence_length": 64, "optimizer": {"lr": 3e-3}},
        "generation": {"max_new_tokens": 8},
        "data": {"train": str(train), "shuffle": False},
        "environments": {"math": {"num_workers": 1}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": 20},
        "ppo": {"critic": {"train_global_batch_size": 32, "train_micro_batch_size": 32, "optimizer": {"lr": 3e-3}}},
        "checkpointing": {"save_period": 20}, "logger": {"progress_bar": False},
    })
    run_algorithm(config)

    train_records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    rewards = [r["reward"] for r in train_records]
    assert len(rewards) == 20
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.2, f"mean reward of the first 4 steps {first:.3f}, of the last 4 {last:.3f}: {rewards}"
    # the critic's values follow the returns it is trained on (both means over generated
    # tokens), which move as the reward rises: the gap falls by a quarter or more
    gaps = [abs(r["ppo/values_mean"] - r["ppo/returns_mean"]) for r in train_records]
    assert sum(gaps[-5:]) / 5 < 0.75 * sum(gaps[:5]) / 5, gaps
    for name in ("ppo/advantages_mean", "ppo/returns_mean", "critic/grad_norm", "critic/value_clip_fraction"):
        assert name in train_records[-1], name
    step = Path(tmp_path / "run" / "checkpoints" / "step_20")
    assert (step / "critic").is_dir() and (step / "policy").is_dir()
