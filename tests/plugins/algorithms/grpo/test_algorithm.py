"""The GRPO loop's parts that need no workers: scoring a rollout batch (checked against an
independent float64 computation), sample keys and seeds, metric assembly, the prompt
stream and its resumable position, random states, environment selection, and the
registration. Whole runs are in tests/e2e/test_grpo_e2e.py."""

from __future__ import annotations

import json
import random
import statistics

import attrs
import pytest
import torch

from posttrain.batch import Batch
from posttrain.config import DataConfig, GenerationConfig, PolicyConfig, RunConfig
from posttrain.data import ChatEncoder, StatefulDataLoader, build_dataset
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.tiny import build_tokenizer
from posttrain.plugins import plugin_host
from posttrain.run.checkpoint import TrainingState, rng_state, set_rng_state
from posttrain.run.metrics import combine_train_passes
from posttrain_grpo.advantages import consecutive_group_ids
from posttrain_grpo.algorithm import GRPO, environment_names
from posttrain_grpo.config import GRPOConfig, OverlongRewardShapingConfig, RewardScalingConfig
from posttrain_grpo.prompts import PromptStream
from posttrain_grpo.step import (
    batch_metrics,
    first_nonfinite,
    nonfinite_fields,
    rollout_summary,
    sample_keys,
    score,
    step_seed,
)
from posttrain_grpo.validation import check_grpo_config
from tests.stand_ins import Numbers


def rollout_batch(rewards, response_lengths, truncated) -> Batch:
    n = len(rewards)
    return Batch(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        response_lengths=torch.tensor(response_lengths),
        truncated=torch.tensor(truncated),
        sample_mask=torch.ones(n),
    )


# ----------------------------------------------------------------------------- scoring


def reference_advantages(rewards: list[float], group_size: int) -> list[float]:
    """Leave-one-out baseline and std of the other samples, normalised where the std > 0."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            baseline, std = statistics.fmean(others), statistics.stdev(others)
            out.append((r - baseline) / (std + 1e-6) if std > 0 else r - baseline)
    return out


def test_score_scales_then_shapes_then_computes_group_advantages():
    grpo = GRPOConfig(
        num_prompts_per_step=2,
        num_generations_per_prompt=4,
        reward_scaling=RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0),
        overlong_reward_shaping=OverlongRewardShapingConfig(enabled=True, buffer_length=4, max_response_length=None, penalty=0.5),
        overlong_filtering=True,
    )
    env_rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    lengths = [3, 8, 10, 6, 7, 9, 5, 12]
    truncated = [False, False, True, False, False, False, False, True]
    batch = rollout_batch(env_rewards, lengths, truncated)

    signal = score(batch, grpo, max_new_tokens=10)  # the penalty starts past 10 - 4 = 6 tokens

    scaled = [2 * r - 1 for r in env_rewards]
    shaped = [s - 0.5 * min(max(n - 6, 0) / 4, 1.0) for s, n in zip(scaled, lengths, strict=True)]
    assert signal.tolist() == pytest.approx(scaled)
    assert batch["shaped_rewards"].tolist() == pytest.approx(shaped)
    assert batch["advantages"].double().tolist() == pytest.approx(reference_advantages(shaped, 4), rel=1e-5)
    assert batch["rewards"].tolist() == env_rewards  # the environments' rewards stay for the logs
    assert batch["sample_mask"].tolist() == [0.0 if t else 1.0 for t in truncated]


def test_score_leaves_filtered_samples_out_of_the_baseline_and_whitens_over_trained_tokens():
    """overlong filtering marks the truncated samples before the advantages: with
    grpo.baseline_valid_only they leave their group's baseline (group 0: mean of 1, 0, 1 = 2/3)
    and get 0; whitening by tokens weighs the trained samples by their token_mask sums."""
    grpo = GRPOConfig(num_prompts_per_step=1, num_generations_per_prompt=4, baseline="mean", normalize_rewards=False,
                      overlong_filtering=True, baseline_valid_only=True)
    batch = rollout_batch([1.0, 0.0, 1.0, 0.0], [2, 3, 1, 4], [False, False, False, True])
    batch["token_mask"] = (torch.arange(5)[None, :] < torch.tensor([2, 3, 1, 4])[:, None]).float()
    score(batch, grpo, max_new_tokens=4)
    assert batch["advantages"].double().tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.0], rel=1e-6)
    batch["sample_mask"] = torch.ones(4)
    score(batch, attrs.evolve(grpo, whiten_advantages="tokens"), max_new_tokens=4)
    weights, values = torch.tensor([2.0, 3.0, 1.0]), torch.tensor([1 / 3, -2 / 3, 1 / 3], dtype=torch.float64)
    mean = (weights * values).sum() / 6
    std = ((weights * (values - mean) ** 2).sum() / 6).sqrt()
    assert batch["advantages"][:3].double().tolist() == pytest.approx(((values - mean) / std).tolist(), rel=1e-5)


def test_score_normalises_each_reward_part_then_sums_them():
    """reward_aggregation normalize_then_sum: the parts reward/correct and reward/format, and
    the overlong penalty as a third, each with its group baseline, summed with reward_weights
    (alphabetical: correct, format, overlong) and whitened."""
    from posttrain_grpo.advantages import normalize_then_sum

    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, baseline="mean",
                      reward_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5, 2.0],
                      overlong_reward_shaping=OverlongRewardShapingConfig(enabled=True, buffer_length=4))
    lengths = [3, 8, 10, 6, 7, 9, 5, 2]
    batch = rollout_batch([1.0] * 8, lengths, [False] * 8)
    batch["reward/correct"] = torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1])
    batch["reward/format"] = torch.tensor([0.5, 0.5, 0, 0, 1, 1, 0, 0.5])
    score(batch, grpo, max_new_tokens=10)
    overlong = torch.tensor([-max(n - 6, 0) / 4 for n in lengths]).clamp(min=-1.0)
    parts = torch.stack([batch["reward/correct"], batch["reward/format"], overlong], dim=1)
    expected = normalize_then_sum(parts, consecutive_group_ids(8, 4), [1.0, 0.5, 2.0], leave_one_out=False,
                                  normalize=True)
    torch.testing.assert_close(batch["advantages"], expected)
    assert abs(float(batch["advantages"].mean())) < 1e-6
    two_parts = rollout_batch([1.0] * 8, lengths, [False] * 8)
    two_parts["reward/correct"], two_parts["reward/format"] = parts[:, 0], parts[:, 1]
    with pytest.raises(ConfigError, match=r"grpo.reward_weights: 3 weights for the 2 reward parts correct, format"):
        score(two_parts, attrs.evolve(grpo, overlong_reward_shaping=OverlongRewardShapingConfig()), max_new_tokens=10)
    with pytest.raises(ConfigError) as info:
        score(rollout_batch([1.0] * 8, lengths, [False] * 8), attrs.evolve(grpo, reward_weights=None), max_new_tokens=10)
    assert str(info.value) == (
        "grpo.reward_aggregation=normalize_then_sum normalises each named reward part apart and needs at least two, "
        "but the environments reported overlong (EnvironmentReturn.reward_components); use an environment that "
        "reports its reward's parts, or grpo.reward_aggregation=sum."
    )


def test_score_with_default_options_uses_the_environment_rewards_as_they_are():
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=3, baseline="mean", normalize_rewards=False)
    batch = rollout_batch([1.0, 0.0, 0.5, 2.0, 2.0, 2.0], [4] * 6, [True] * 6)
    signal = score(batch, grpo, max_new_tokens=4)
    assert signal.tolist() == batch["shaped_rewards"].tolist() == [1.0, 0.0, 0.5, 2.0, 2.0, 2.0]
    assert batch["advantages"].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert batch["sample_mask"].tolist() == [1.0] * 6  # no overlong filtering unless asked


@pytest.mark.parametrize("baseline_valid_only", [False, True])
def test_samples_the_environment_could_not_score_neither_train_nor_count(baseline_valid_only):
    """Sample 1 failed (its reward 0 is no reward): sample_mask 0, and the leave-one-out
    baseline and std of its group are those of the group's three scored samples alone, as if
    it were not there; whatever grpo.baseline_valid_only says. Its signal is NaN."""
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, baseline_valid_only=baseline_valid_only)
    batch = rollout_batch([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], [4] * 8, [False] * 8)
    batch["failed"] = torch.tensor([False, True, False, False, False, False, False, False])
    signal = score(batch, grpo, max_new_tokens=10)
    assert batch["sample_mask"].tolist() == [1.0, 0.0] + [1.0] * 6
    scored = [1.0, 0.0, 1.0]  # group 0 without sample 1
    expected = reference_advantages(scored, 3)
    assert batch["advantages"][[0, 2, 3]].double().tolist() == pytest.approx(expected, rel=1e-5)
    assert batch["advantages"][1] == 0.0
    assert batch["advantages"][4:].double().tolist() == pytest.approx(reference_advantages([1.0, 0, 0, 0], 4), rel=1e-5)
    assert signal[1].isnan() and not signal[[0, 2, 3, 4, 5, 6, 7]].isnan().any()


def test_the_step_reward_leaves_failed_samples_out():
    batch = Batch(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), failed=torch.tensor([False, True, True, False]))
    assert rollout_summary([(batch, {"env/math/retried": 4.0})]) == {"env/math/retried": 4.0, "reward": 1.0}


# ----------------------------------------------------------------------------- keys and seeds


def test_sample_keys_name_each_prompt_and_generation_once_in_batch_order():
    keys = sample_keys(3, 2)
    assert keys == ["0_g0", "0_g1", "1_g0", "1_g1", "2_g0", "2_g1"]
    assert len(set(sample_keys(50, 16))) == 800


def test_step_seeds_depend_only_on_seed_phase_and_step():
    assert step_seed(42, "train", 7) == step_seed(42, "train", 7)
    seeds = {step_seed(seed, phase, step) for seed in (0, 1) for phase in ("train", "validation") for step in range(500)}
    assert len(seeds) == 2000
    assert all(0 <= s < 2**31 for s in seeds)


# ----------------------------------------------------------------------------- metrics


def test_train_metrics_of_several_optimizer_steps():
    parts = [
        {"loss": 1.0, "ratio_max": 1.1, "ratio_min": 0.9, "num_tokens": 10.0, "step_time_s": 0.5},
        {"loss": 3.0, "ratio_max": 1.3, "ratio_min": 0.95, "num_tokens": 14.0, "step_time_s": 0.25},
    ]
    combined = combine_train_passes(parts, {"ratio_max": "max", "ratio_min": "min"})
    assert combined == {"loss": 2.0, "ratio_max": 1.3, "ratio_min": 0.9, "num_tokens": 24.0, "step_time_s": 0.75}


def test_rollout_summary_sums_counts_and_weights_means_by_samples():
    first = Batch(rewards=torch.tensor([1.0, 0.0]))
    second = Batch(rewards=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    summary = rollout_summary([
        (first, {"rollout/mean_turns": 1.0, "env/math/errors": 1.0, "rollout/generated_tokens": 10.0,
                 "data/a/samples": 2.0, "data/a/mean_reward": 0.5}),
        (second, {"rollout/mean_turns": 2.5, "env/math/errors": 2.0, "rollout/generated_tokens": 30.0,
                  "env/math/accuracy": 0.75, "data/a/samples": 1.0, "data/a/mean_reward": 1.0,
                  "data/b/samples": 3.0, "data/b/mean_reward": 2 / 3}),
    ])
    assert summary == {
        "rollout/mean_turns": pytest.approx((2 * 1.0 + 4 * 2.5) / 6),
        "env/math/errors": 3.0,
        "rollout/generated_tokens": 40.0,
        "data/a/samples": 3.0,  # a mixture source's counts add up, its means weigh by its own samples
        "data/a/mean_reward": pytest.approx((2 * 0.5 + 1 * 1.0) / 3),
        "env/math/accuracy": 0.75,  # only the rollout that reported it
        "data/b/samples": 3.0,
        "data/b/mean_reward": pytest.approx(2 / 3),
        "reward": pytest.approx(4 / 6),
    }


def test_batch_metrics():
    batch = Batch(
        sample_mask=torch.tensor([1.0, 0.0, 1.0]),
        advantages=torch.tensor([0.5, -1.0, 0.5]),
        shaped_rewards=torch.tensor([1.0, 0.0, 0.5]),
        input_lengths=torch.tensor([10, 12, 8]),
        prompt_lengths=torch.tensor([4, 4, 5]),
        response_lengths=torch.tensor([6, 8, 3]),
    )
    assert batch_metrics(batch) == pytest.approx({
        "trained_reward": 0.5,
        "advantages/mean": 0.0,
        "advantages/min": -1.0,
        "advantages/max": 0.5,
        "num_valid_samples": 2.0,
        "mean_prompt_length": 13 / 3,
        "mean_response_length": 17 / 3,
        "max_sequence_length": 12.0,
        "total_num_tokens": 30.0,
    })


def test_non_finite_values_are_found():
    batch = Batch(
        advantages=torch.tensor([0.0, float("nan")]),
        prev_logprobs=torch.tensor([[-1.0, float("-inf")], [0.0, -2.0]]),
        rewards=torch.tensor([1.0, 0.0]),
        input_ids=torch.tensor([[1, 2], [3, 4]]),
    )
    assert nonfinite_fields(batch) == ["advantages", "prev_logprobs"]
    assert first_nonfinite({"loss": 0.5, "grad_norm": float("inf")}, ("loss", "grad_norm")) == "grad_norm"
    assert first_nonfinite({"loss": 0.5}, ("loss", "grad_norm")) is None


# ----------------------------------------------------------------------------- data and state


def drain(stream: PromptStream) -> list[list[int]]:
    batches = []
    while (batch := stream.next()) is not None:
        batches.append(batch["value"].tolist())
    return batches


def test_prompt_stream_runs_the_given_number_of_epochs():
    stream = PromptStream(StatefulDataLoader(Numbers(5), 2, shuffle=True, seed=3), max_epochs=2)
    assert stream.total_batches == 4
    batches = drain(stream)
    assert len(batches) == 4
    assert sorted(v for b in batches[:2] for v in b) != sorted(range(5))  # drop_last: 4 of 5 per epoch
    assert batches[:2] != batches[2:]  # each epoch has its own order
    assert stream.next() is None


def test_prompt_stream_resumes_from_the_saved_position(tmp_path):
    loader = StatefulDataLoader(Numbers(9), 2, shuffle=True, seed=1)
    full = drain(PromptStream(loader, max_epochs=3))
    loader = StatefulDataLoader(Numbers(9), 2, shuffle=True, seed=1)
    first = PromptStream(loader, max_epochs=3)
    head = [first.next()["value"].tolist() for _ in range(6)]  # into the second epoch
    torch.save(loader.state_dict(), tmp_path / "dataloader.pt")  # as a checkpoint stores it
    resumed = StatefulDataLoader(Numbers(9), 2, shuffle=True, seed=1)
    resumed.load_state_dict(torch.load(tmp_path / "dataloader.pt"))
    assert head + drain(PromptStream(resumed, max_epochs=3)) == full


def test_random_states_survive_the_checkpoint_file(tmp_path):
    import numpy as np

    torch.save(rng_state(), tmp_path / "rng.pt")
    drawn = (random.random(), torch.rand(3).tolist(), np.random.rand())
    set_rng_state(torch.load(tmp_path / "rng.pt"))  # weights_only: plain tensors and numbers
    assert (random.random(), torch.rand(3).tolist(), np.random.rand()) == drawn


def test_a_checkpoint_without_grpo_state_is_refused(tmp_path):
    (tmp_path / "policy").mkdir()
    with pytest.raises(CheckpointError, match=r"has no dataloader\.pt, rng\.pt; it was not written by a GRPO run"):
        TrainingState(policy=None, loader=None).load(tmp_path, "GRPO")  # refused before either is touched


# ----------------------------------------------------------------------------- environments


@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(build_tokenizer())


def prompt_dataset(tmp_path, name: str, tasks: list[str | None], encoder):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": "1", "target": 1, **({"task": t} if t else {})}
            for i, t in enumerate(tasks)]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_dataset(path, "prompt", encoder)


def test_environments_come_from_the_data_and_the_config(tmp_path, encoder):
    train = prompt_dataset(tmp_path, "train", ["math", "math"], encoder)
    val = prompt_dataset(tmp_path, "val", ["guess_number"], encoder)
    config = RunConfig(environments={"reverse": {}})
    assert environment_names(config, [train, val]) == (["guess_number", "math", "reverse"], None)


def test_rows_without_a_task_go_to_the_only_environment(tmp_path, encoder):
    train = prompt_dataset(tmp_path, "train", [None, "math"], encoder)
    assert environment_names(RunConfig(environments={"math": {}}), [train, None]) == (["math"], "math")
    assert environment_names(RunConfig(), [prompt_dataset(tmp_path, "t2", [None], encoder)] * 1 + [train]) == (
        ["math"], "math"
    )


def test_rows_without_a_task_and_several_environments_are_refused(tmp_path, encoder):
    train = prompt_dataset(tmp_path, "train", [None, "math"], encoder)
    with pytest.raises(ConfigError, match=r"some data rows have no 'task', and there are 2 environments \(math, reverse\)"):
        environment_names(RunConfig(environments={"reverse": {}}), [train])
    with pytest.raises(ConfigError, match=r"the data rows name no 'task' and the config has no 'environments' section"):
        environment_names(RunConfig(), [prompt_dataset(tmp_path, "none", [None], encoder)])


def test_an_unknown_task_names_the_data_key_file_and_row(tmp_path, encoder):
    train = prompt_dataset(tmp_path, "train", ["math", "math", "mth"], encoder)
    with pytest.raises(ConfigError) as info:
        environment_names(RunConfig(), [train])
    message = str(info.value)
    assert message.startswith(f"the data ({tmp_path}/train.jsonl) row 3, key 'task': unknown environment 'mth'; installed: ")
    assert message.endswith("Did you mean 'math'? Correct the row's task, or install the plugin that provides 'mth'.")
    with pytest.raises(ConfigError, match=r"^environments.gues_number: unknown environment 'gues_number'; installed: "):
        environment_names(RunConfig(environments={"gues_number": {}}), [train])


def test_rows_without_what_their_environment_needs_are_left_out_with_skip_malformed(tmp_path, encoder):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "task": "guess_number",
             **({"target": i} if i != 1 else {})} for i in range(3)]
    (tmp_path / "games.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    games = build_dataset(tmp_path / "games.jsonl", "prompt", encoder)
    config = RunConfig(data=DataConfig(skip_malformed=True))
    assert environment_names(config, [games]) == (["guess_number"], None)
    assert [games[i]["row"] for i in range(len(games))] == [1, 3]
    assert (games.report.num_examples, games.report.num_skipped) == (2, 1)
    assert games.report.skipped == (
        f"{tmp_path / 'games.jsonl'} row 2: the guess_number environment needs 'target' (the integer the model must "
        "guess) in each of its rows, and this row has none (its metadata keys: none)",
    )


def test_plugin_modules_add_environments_to_the_check(tmp_path, encoder):
    scripted = prompt_dataset(tmp_path, "scripted", ["scripted"], encoder)
    with pytest.raises(ConfigError, match="row 1, key 'task': unknown environment 'scripted'"):
        environment_names(RunConfig(), [scripted])
    assert environment_names(RunConfig(), [scripted], plugins=["tests.e2e.grpo_environments"]) == (["scripted"], None)


# ----------------------------------------------------------------------------- registration and config


def test_grpo_is_the_registered_algorithm():
    host = plugin_host()
    assert isinstance(host.algorithms["grpo"](), GRPO)
    assert host.algorithms.distribution_of("grpo").startswith("posttrain-grpo ")
    assert GRPO().config_section == "grpo"


def test_max_val_samples_must_be_positive():
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_val_samples=0)
    config = RunConfig(
        algorithm="grpo", policy=PolicyConfig(train_global_batch_size=8), generation=GenerationConfig(),
        sections={"grpo": grpo},
    )
    with pytest.raises(ConfigError, match=r"grpo\.max_val_samples: must be >= 1, or null for the whole validation set, got 0"):
        check_grpo_config(grpo, config)


def test_an_unset_schedule_horizon_becomes_the_runs_optimizer_steps():
    from posttrain.config import SchedulerConfig

    config = RunConfig(policy=PolicyConfig(scheduler=SchedulerConfig(name="cosine")), sections={"grpo": GRPOConfig()})
    filled = config.with_schedule_horizon(40)
    assert filled.policy.scheduler.total_steps == 40 and filled.sections == config.sections
    assert config.policy.scheduler.total_steps is None  # the original is left alone
    chosen = RunConfig(policy=PolicyConfig(scheduler=SchedulerConfig(name="cosine", total_steps=7)))
    assert chosen.with_schedule_horizon(40).policy.scheduler.total_steps == 7
