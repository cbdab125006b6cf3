"""Each GRPO loss variant learns: on the task a random tiny model can learn by RL alone
(answer "7", :func:`~tests.e2e.test_grpo_e2e.seven_rows`), 20 steps of one seed raise the mean
reward of the last 4 steps at least 0.2 above the first 4's, as the default loss does in
tests/e2e/test_grpo_e2e.py. The runs go through the whole loop: the bypass mode skips the
previous-logprob pass, the KL variants add the reference pass, ``bnpo`` trains in 4
microbatches.
"""

from __future__ import annotations

import pytest

from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_grpo.config import ClippedPGConfig, GRPOConfig
from tests.e2e.test_grpo_e2e import assert_finite, make_config, seven_rows, write_rows

pytestmark = [pytest.mark.ray, pytest.mark.slow]

VARIANTS = {
    "cispo": {"policy_loss": "cispo", "ratio_clip_low": 1.0, "ratio_clip_high": 4.0},
    "sapo": {"policy_loss": "sapo", "token_level_loss": False},
    "dr_grpo": {"token_normalizer": "constant"},
    "bnpo": {"token_normalizer": "microbatch"},
    "gspo_product_tis": {"token_level_loss": False, "sequence_level_ratio": True, "sequence_is_weight": "product",
                         "importance_sampling_correction": "tis", "is_max": 2.0,
                         "ratio_clip_low": 0.003, "ratio_clip_high": 0.004},
    "kl_in_reward": {"kl_penalty": 0.01, "kl_in_reward": "return_to_go"},
    "kl_on_policy_approximation": {"kl_penalty": 0.01, "kl_importance_weight": "generation"},
    "bypass": {"rollout_correction": "bypass"},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_loss_variant_raises_the_reward(ray_cluster, tiny_model_path, tmp_path, name):
    train = write_rows(tmp_path / "train.jsonl", seven_rows(80))
    grpo = GRPOConfig(num_prompts_per_step=4, num_generations_per_prompt=8, max_num_steps=20,
                      loss=ClippedPGConfig(**VARIANTS[name]))
    config = make_config(tiny_model_path, tmp_path / "run", train, grpo)
    if name == "bnpo":
        config.policy.train_micro_batch_size = grpo.samples_per_step // 4
    run_algorithm(config)

    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    rewards = [r["reward"] for r in records]
    assert len(rewards) == 20
    for record in records:
        assert_finite(record)
    if "kl_penalty" in VARIANTS[name]:
        assert all("kl" in r for r in records)  # the reference pass ran
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.2, f"{name}: mean reward of the first 4 steps {first:.3f}, of the last 4 {last:.3f}: {rewards}"
