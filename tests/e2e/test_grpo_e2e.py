"""Whole GRPO runs on CPU: the dtensor policy, the hf generation backend and environments in
Ray actors, with the tiny character-level model.

- the example config runs through the CLI and leaves metrics, validation and a checkpoint;
- a task a random tiny model can learn by RL alone (answer "7": the math environment reads
  the last number of the response) gets a measurably higher reward after 20 steps;
- a run stopped after step 2 and resumed logs exactly the step-3 metrics of an
  uninterrupted run (with dynamic sampling on, so the data position is not the step);
- dynamic sampling decides from the data plane's tags and never fetches a dropped group;
- a multi-turn game (guess_number) trains through the same loop;
- samples an environment fails on are counted and trained on by no loss; an environment
  actor killed mid-step is retried and the run's metrics are those of an uninterrupted run;
  a NaN reward makes the loss NaN: the run stops naming the step and the metric, and the
  last checkpoint stays as it was;
- a refit that leaves the engine's weights stale stops the run at the mismatch guard.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch

import posttrain_hf.generation
from posttrain import cli
from posttrain.builtin.memory_plane import MemoryDataPlane
from posttrain.config.schema import (
    CheckpointConfig,
    DataConfig,
    GenerationConfig,
    LoggerConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
from posttrain.run.context import RunContext, run_algorithm, seed_everything
from posttrain.run.loop import RunEndedEarly
from posttrain.run.metrics import read_metrics
from posttrain_env_math.guess_number import guess_number_prompt
from posttrain_grpo.algorithm import GRPO
from posttrain_grpo.config import DynamicSamplingConfig, GRPOConfig, MismatchGuardConfig
from posttrain_grpo.mismatch import MismatchTooLarge
from posttrain_grpo.step import TrainingDiverged
from tests.e2e.stale_engine import StaleHeadEngineWorker

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
TEST_ENVIRONMENTS = "tests.e2e.grpo_environments"
#: Metrics that measure time, not what was computed.
TIMING_PREFIXES = ("timing/", "throughput/", "refit/seconds", "step_time_s", "time")


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def seven_rows(count: int) -> list[dict]:
    """Prompts whose answer is always 7: learnable without understanding the prompt."""
    return [{"messages": [{"role": "user", "content": f"Say seven. ({i})"}], "answer": "7", "task": "math"} for i in range(count)]


def spread_rows(count: int) -> list[dict]:
    """Prompts of the ``scripted`` test environment whose rewards differ within every group
    (``spread``), so that every GRPO step has advantages and moves the weights."""
    return [{"messages": [{"role": "user", "content": f"hi {i}"}], "metadata": {"reward": "spread"}, "task": "scripted"}
            for i in range(count)]


def make_config(model: str, run_dir: Path, train: str, grpo: GRPOConfig, **overrides) -> RunConfig:
    """A CPU GRPO run: one policy worker, one generation engine, math verified (in the driver, by default)."""
    samples = grpo.samples_per_step
    fields = dict(
        seed=3,
        run_dir=str(run_dir),
        algorithm="grpo",
        policy=PolicyConfig(
            model=model,
            train_global_batch_size=samples,
            train_micro_batch_size=samples,
            logprob_micro_batch_size=samples,
            max_total_sequence_length=64,
            optimizer=OptimizerConfig(lr=3e-3),
            resources=WorkerResources(cpus=1),
        ),
        generation=GenerationConfig(max_new_tokens=8, resources=WorkerResources(cpus=1)),
        data=DataConfig(train=train, shuffle=False),
        environments={"math": {"num_workers": 1}},
        checkpointing=CheckpointConfig(save_period=100),
        logger=LoggerConfig(progress_bar=False),
        sections={"grpo": grpo},
    )
    fields.update(overrides)
    return RunConfig(**fields)


def run_grpo(config: RunConfig) -> dict:
    """``config`` run in this process, with the test environments registered in every actor."""
    seed_everything(config.seed)
    ctx = RunContext(config)
    try:
        return GRPO(environment_plugins=[TEST_ENVIRONMENTS]).run(ctx)
    finally:
        ctx.close()


def comparable(record: dict) -> dict:
    """The numeric metrics of a record that do not measure time."""
    return {k: v for k, v in record.items() if k != "phase" and not k.startswith(TIMING_PREFIXES)}


def assert_finite(record: dict) -> None:
    bad = {k: v for k, v in record.items() if k != "phase" and not (isinstance(v, float | int) and math.isfinite(v))}
    assert not bad, f"non-finite metrics at step {record['step']}: {bad}"


# ----------------------------------------------------------------------------- the example config


def test_example_config_runs_through_the_cli(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the example's data paths are relative to the repository root
    run_dir = tmp_path / "run"
    code = cli.main([
        "run", "grpo", "--config", "examples/configs/grpo_math_tiny.yaml",
        f"policy.model={tiny_model_path}", f"run_dir={run_dir}", "grpo.max_num_steps=2", "grpo.val_period=2",
        "grpo.max_val_samples=4", "checkpointing.save_period=2", "logger.progress_bar=false",
    ])
    assert code == 0

    train = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert_finite(record)
        for name in ("reward", "loss", "grad_norm", "env/math/accuracy", "env/math/errors", "advantages/mean",
                     "timing/rollout", "timing/logprobs", "timing/training", "timing/refit", "throughput/tokens_per_s"):
            assert name in record, f"step {record['step']} did not log {name}"
        assert record["num_valid_samples"] == 32
        assert record["reward"] == pytest.approx(record["env/math/accuracy"])  # both: mean 0/1 reward
        # Generation and trainer (on policy: its training pass) compute the same float32
        # logprobs: the sampled tokens' probabilities agree to within 0.1%.
        assert 1.0 <= record["token_mult_prob_error"] < 1.001
    validation = read_metrics(run_dir / "metrics.jsonl", "validation")
    assert [r["step"] for r in validation] == [0, 2]  # val_at_start, then every 2 steps
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in validation)

    step_2 = run_dir / "checkpoints" / "step_2"
    assert sorted(p.name for p in step_2.iterdir()) == [
        "config.yaml", "dataloader.pt", "policy", "rng.pt", "training_info.json"
    ]
    assert torch.load(step_2 / "dataloader.pt")["position"] == 2  # one prompt batch per step
    assert json.loads((step_2 / "training_info.json").read_text())["metrics"]["validation/accuracy"] == validation[-1]["accuracy"]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_example_on_a_tied_embedding_qwen2_in_vllm_keeps_generation_and_training_equal(ray_cluster, tmp_path,
                                                                                              monkeypatch):
    """Qwen2 ties its output embedding to the input one; vLLM's reload used to leave the LM
    head's packed copy from start-up, so every refit widened the gap (1.02, 1.04 here)."""
    pytest.importorskip("vllm", reason="vllm is not installed (pip install 'posttrain-vllm[cpu]')")
    from posttrain.testing.zoo import build_zoo_model

    model = build_zoo_model(tmp_path / "qwen2", "qwen2")
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    code = cli.main([
        "run", "grpo", "--config", "examples/configs/grpo_math_tiny.yaml", f"policy.model={model}",
        "generation.backend=vllm", "generation.refit_checksums=true", f"run_dir={run_dir}", "grpo.max_num_steps=3",
        "grpo.val_period=0", "logger.progress_bar=false",
    ])
    assert code == 0
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(1.0 <= r["token_mult_prob_error"] < 1 + 1e-5 for r in train), [r["token_mult_prob_error"] for r in train]


# ----------------------------------------------------------------------------- learning


def test_reward_rises_on_a_learnable_task(ray_cluster, tiny_model_path, tmp_path):
    train = write_rows(tmp_path / "train.jsonl", seven_rows(80))
    grpo = GRPOConfig(num_prompts_per_step=4, num_generations_per_prompt=8, max_num_steps=20)
    run_algorithm(make_config(tiny_model_path, tmp_path / "run", train, grpo))

    rewards = [r["reward"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")]
    assert len(rewards) == 20
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    # A random model answers 7 about one time in eight; RL alone should at least triple it.
    assert last > first + 0.2, f"mean reward of the first 4 steps {first:.3f}, of the last 4 {last:.3f}: {rewards}"


# ----------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_resumed_run_matches_an_uninterrupted_one(ray_cluster, tiny_model_path, tmp_path):
    train = write_rows(tmp_path / "train.jsonl", seven_rows(160))
    grpo = GRPOConfig(
        num_prompts_per_step=2, num_generations_per_prompt=8, max_num_steps=3,
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_gen_batches=20),
    )
    checkpoints = CheckpointConfig(save_period=2)
    run_algorithm(make_config(tiny_model_path, tmp_path / "full", train, grpo, checkpointing=checkpoints))

    two_steps = attrs.evolve(grpo, max_num_steps=2)
    run_algorithm(make_config(tiny_model_path, tmp_path / "stopped", train, two_steps, checkpointing=checkpoints))
    assert [p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()] == ["step_2"]
    saved = torch.load(tmp_path / "stopped" / "checkpoints" / "step_2" / "dataloader.pt")
    consumed = sum(r["dynamic_sampling/gen_batches"] for r in read_metrics(tmp_path / "stopped" / "metrics.jsonl"))
    assert saved["position"] == consumed > 2  # dynamic sampling drew more than one prompt batch per step
    run_algorithm(make_config(tiny_model_path, tmp_path / "stopped", train, grpo, checkpointing=checkpoints))

    full = read_metrics(tmp_path / "full" / "metrics.jsonl", "train")
    resumed = read_metrics(tmp_path / "stopped" / "metrics.jsonl", "train")
    assert [r["step"] for r in resumed] == [1, 2, 3]  # the resumed run appended step 3 only
    expected, found = comparable(full[2]), comparable(resumed[2])
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert found[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    full_position = torch.load(tmp_path / "full" / "checkpoints" / "step_3" / "dataloader.pt")
    assert torch.load(tmp_path / "stopped" / "checkpoints" / "step_3" / "dataloader.pt") == full_position


@pytest.mark.slow
def test_where_the_engine_runs_does_not_change_the_metrics(ray_cluster, tiny_model_path, tmp_path):
    """``generation.colocated: false``: the engine keeps its own CPU worker (no offload or
    sleep between stages) and gets every step's weights by the same worker-to-worker sync;
    ``generation.in_policy_workers``: the engine runs inside the policy's worker and the
    refit loads the weights in memory; left null, it is chosen there (hf on CPUs), the policy's
    worker runs in the driver's process (``policy.in_driver`` left null; the engine of its own
    then gets the weights from the driver), and the math environment runs in the driver's
    process (``environments.math.in_driver`` left null) instead of an actor of its own. Every
    run's metrics equal those of the colocated run with a policy process, an engine process
    and an environment actor of their own, step by step; an engine in the policy's worker
    computes from the policy's own weight tensors (no copy), whose memory can round its
    logprobs otherwise in the last bit, so there the engine-trainer mismatch metrics (float32
    rounding: KL near 1e-14) agree within 1e-6."""
    train = write_rows(tmp_path / "train.jsonl", seven_rows(40))
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=8, max_num_steps=3)
    in_actors = {"math": {"num_workers": 1, "in_driver": False}}
    placements = {"colocated": ({"in_policy_workers": False}, False, in_actors),
                  "apart": ({"colocated": False}, None, in_actors),
                  "in_policy": ({"in_policy_workers": True}, False, in_actors), "default": ({}, None, None)}
    runs = {}
    for name, (settings, in_driver, environments) in placements.items():
        config = make_config(tiny_model_path, tmp_path / name, train, grpo)
        config = attrs.evolve(config, generation=attrs.evolve(config.generation, **settings),
                              policy=attrs.evolve(config.policy, in_driver=in_driver),
                              environments=environments or config.environments)
        run_algorithm(config)
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl", "train")
    events = {name: (tmp_path / name / "events.jsonl").read_text() for name in placements}
    said = ("policy worker inside the driver's process", "generation engines inside the policy's workers",
            "environment in the driver's process")
    chosen = {name: tuple(line in text for line in said) for name, text in events.items()}
    assert chosen == {"colocated": (False, False, False), "apart": (True, False, False),
                      "in_policy": (False, False, False), "default": (True, True, True)}, chosen
    for name in ("apart", "in_policy", "default"):
        assert [r["step"] for r in runs[name]] == [1, 2, 3], name
        for together, other in zip(runs["colocated"], runs[name], strict=True):
            ours, theirs = comparable(other), comparable(together)
            assert ours.keys() == theirs.keys(), name
            rounded = {k for k in ours if name != "apart" and k.startswith("mismatch")}
            step = f"{name}, step {together['step']}"
            assert {k: ours[k] for k in ours.keys() - rounded} == {k: theirs[k] for k in theirs.keys() - rounded}, step
            assert all(abs(ours[k] - theirs[k]) <= 1e-6 for k in rounded), (step, {k: (ours[k], theirs[k]) for k in rounded})
    # the runs trained (a step whose groups all scored alike has no gradient) and refit
    assert max(r["grad_norm"] for r in runs["colocated"]) > 0 and runs["colocated"][-1]["refit/bytes"] > 0


class RecordingPlane(MemoryDataPlane):
    """The in-memory plane, recording which keys each ``get`` reads and every put's tags."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched: dict[str, set[str]] = {}
        self.signal: dict[str, dict[str, float]] = {}

    def put(self, partition, keys, fields, tags=None):
        for key, value in zip(keys, (tags or {}).get("signal_reward", []), strict=False):
            self.signal.setdefault(partition, {})[key] = float(value)
        super().put(partition, keys, fields, tags)

    def get(self, partition, keys, fields):
        self.fetched.setdefault(partition, set()).update(keys)
        return super().get(partition, keys, fields)


def test_dynamic_sampling_never_fetches_dropped_groups(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    """Every rollout goes into the step's partition tagged with its signal reward; the loop
    fetches the kept groups only: never a group whose rewards are all equal."""
    plane = RecordingPlane()
    monkeypatch.setattr(RunContext, "build_data_plane", lambda self: plane)
    train = write_rows(tmp_path / "train.jsonl", seven_rows(64))
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2,
                      dynamic_sampling=DynamicSamplingConfig(enabled=True, max_gen_batches=20))
    run_algorithm(make_config(tiny_model_path, tmp_path, train, grpo))

    steps = read_metrics(tmp_path / "metrics.jsonl", "train")
    dropped = 0
    for step in (1, 2):
        partition = f"train/{step}"
        groups: dict[str, list[float]] = {}
        for key, reward in plane.signal[partition].items():
            groups.setdefault(key.split("_g")[0], []).append(reward)
        fetched_groups = {key.split("_g")[0] for key in plane.fetched[partition]}
        assert len(plane.fetched[partition]) == grpo.samples_per_step
        assert all(len(set(groups[g])) > 1 for g in fetched_groups), "a group without signal was fetched"
        dropped += len(groups) - len(fetched_groups)
    without_signal = sum(r["dynamic_sampling/groups_generated"] - r["dynamic_sampling/groups_with_signal"] for r in steps)
    surplus = sum(r["dynamic_sampling/groups_surplus"] for r in steps)
    assert dropped == without_signal + surplus and without_signal > 0  # groups were dropped, none was read
    assert plane.partitions() == []  # every step's partition was cleared


def test_dynamic_sampling_that_runs_out_of_prompts_stops_the_run_saying_why(ray_cluster, tiny_model_path, tmp_path):
    """Only the first of 4 prompts gives rewards that differ: step 1 fills, step 2 draws the
    other 3 and the epoch ends. The run stops with an error naming both ways out, after
    saving step 1; following the first (more epochs) the resumed run does its 3 steps."""
    rewards = ["spread", "0.0", "0.0", "0.0"]
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}], "metadata": {"reward": r}, "task": "scripted"}
            for i, r in enumerate(rewards)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    grpo = GRPOConfig(num_prompts_per_step=1, num_generations_per_prompt=4, max_num_steps=3,
                      dynamic_sampling=DynamicSamplingConfig(enabled=True, max_gen_batches=20))
    config = make_config(tiny_model_path, tmp_path / "run", train, grpo, environments={})
    with pytest.raises(RunEndedEarly) as failure:
        run_grpo(config)
    assert str(failure.value) == (
        "GRPO stopped after step 1 of 3: the prompts ran out (grpo.max_num_epochs=1 epochs of 4 prompt batches) "
        "while dynamic sampling filled step 2: its 3 batches gave 0 of the 1 prompts with differing rewards a step "
        "needs; so far a step took 4.0 batches. Set grpo.max_num_epochs: 4 (that many for 3 steps, with a margin), "
        "or grpo.max_num_steps: 1. Nothing was exported; the checkpoint "
        f"{tmp_path / 'run' / 'checkpoints' / 'step_1'} holds step 1; the run resumes from it when started again."
    )
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")] == [1]

    run_grpo(attrs.evolve(config, sections={"grpo": attrs.evolve(grpo, max_num_epochs=4)}))
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")] == [1, 2, 3]


# ----------------------------------------------------------------------------- multi-turn


def test_multi_turn_game_trains_through_the_loop(ray_cluster, tiny_model_path, tmp_path):
    rows = [
        {"messages": guess_number_prompt(1, 5), "metadata": {"target": 1 + i % 5, "low": 1, "high": 5}, "task": "guess_number"}
        for i in range(4)
    ]
    train = write_rows(tmp_path / "train.jsonl", rows)
    # The separate previous-logprob pass (skipped on policy elsewhere) is exercised here.
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2, max_rollout_turns=3,
                      skip_prev_logprobs_when_on_policy=False)
    config = make_config(
        tiny_model_path, tmp_path / "run", train, grpo,
        environments={"guess_number": {"max_guesses": 3}},
    )
    config.policy.max_total_sequence_length = 384
    result = run_algorithm(config)

    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2] and result["step"] == 2
    for record in records:
        assert_finite(record)
        # A random model writes no <guess>N</guess>: each game gets reminders until its 3 turns are spent.
        assert record["rollout/mean_turns"] == 3.0
        assert record["env/guess_number/mean_guesses"] == 3.0
        # The trainer's logprobs (its previous-logprob pass) of every turn's generated tokens match
        # the generation backend's: the multi-turn token sequence and its loss mask line up.
        assert 1.0 <= record["token_mult_prob_error"] < 1.001


# ----------------------------------------------------------------------------- divergence


def test_failed_samples_are_left_out_and_a_nan_loss_stops_the_run(ray_cluster, tiny_model_path, tmp_path):
    # Two prompts (4 samples each) per step: in step 1 the environment fails on every sample
    # of the first, the second scores 1; step 2 scores 0; step 3's rewards are NaN.
    metadata = [{"reward": "1.0", "error": "cannot score this"}, {"reward": "1.0"}, {"reward": "0.0"}, {"reward": "0.0"},
                {"reward": "nan"}, {"reward": "nan"}]
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}], "metadata": meta, "task": "scripted"}
            for i, meta in enumerate(metadata)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=3)
    config = make_config(tiny_model_path, tmp_path / "run", train, grpo, environments={},
                         checkpointing=CheckpointConfig(save_period=1))
    with pytest.raises(TrainingDiverged) as failure:
        run_grpo(config)

    message = str(failure.value)
    assert "GRPO step 3: the training metric 'loss' is nan" in message
    assert "Non-finite inputs in the step's batch: advantages" in message
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"the last checkpoint ({checkpoints / 'step_2'})" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]
    assert json.loads((checkpoints / "step_2" / "training_info.json").read_text())["step"] == 2
    assert (checkpoints / "step_2" / "policy").is_dir() and (checkpoints / "step_2" / "rng.pt").is_file()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2]
    # The failed samples are counted and trained on by no loss: neither as the 1.0 the data
    # asked for nor as 0; the step's reward is the scored samples'.
    assert (records[0]["num_valid_samples"], records[0]["env/scripted/errors"], records[0]["reward"]) == (4.0, 4.0, 1.0)
    assert (records[1]["num_valid_samples"], records[1]["reward"], records[1]["env/scripted/errors"]) == (8.0, 0.0, 0.0)


def test_an_environment_actor_killed_mid_step_is_retried_and_the_run_is_unchanged(ray_cluster, tiny_model_path, tmp_path):
    """SIGKILL of the environment's actor during step 2's call: the call is made again on a
    fresh actor, and every metric of both steps equals the uninterrupted run's (only the
    count of samples sent again differs)."""
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2)

    def run(name: str, **metadata) -> list[dict]:
        rows = [{"messages": [{"role": "user", "content": f"Say seven. ({i})"}], "task": "mortal", "metadata": metadata}
                for i in range(4)]
        train = write_rows(tmp_path / f"{name}.jsonl", rows)
        run_grpo(make_config(tiny_model_path, tmp_path / name, train, grpo, environments={}))
        return read_metrics(tmp_path / name / "metrics.jsonl", "train")

    uninterrupted = run("uninterrupted")
    killed = run("killed", counter=str(tmp_path / "calls"), die_at_call=2)
    assert (tmp_path / "calls").read_text() == "3"  # the second call died; a fresh actor took the third
    assert [r["env/mortal/retried"] for r in killed] == [0.0, 8.0]
    assert [r["env/mortal/errors"] for r in killed] == [0.0, 0.0]
    assert uninterrupted[1]["reward"] > 0  # what a call that failed unseen would have replaced with 0
    for before, after in zip(uninterrupted, killed, strict=True):
        assert {k: v for k, v in comparable(after).items() if k != "env/mortal/retried"} == \
            {k: v for k, v in comparable(before).items() if k != "env/mortal/retried"}, f"step {before['step']}"


def test_a_stale_refit_stops_the_run_at_the_mismatch_guard(ray_cluster, tiny_model_path, tmp_path, monkeypatch, capsys):
    """The refit broken on purpose: the engine drops the output head it receives, so from step 2
    it samples from a model whose head is stale, and the guard stops the run. Rewards that
    differ in every group (``spread``) make every step change the weights."""
    monkeypatch.setattr(posttrain_hf.generation, "HFEngineWorker", StaleHeadEngineWorker)
    train = write_rows(tmp_path / "train.jsonl", spread_rows(16))
    guard = MismatchGuardConfig(warn_token_mult_prob_error=1.0001, stop_token_mult_prob_error=1.01)
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=4, mismatch_guard=guard)
    config = make_config(tiny_model_path, tmp_path / "run", train, grpo, environments={})
    config = attrs.evolve(config, policy=attrs.evolve(config.policy, optimizer=OptimizerConfig(lr=3e-2)))
    with pytest.raises(MismatchTooLarge) as failure:
        run_grpo(config)

    message = str(failure.value)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert 1.0 <= records[0]["token_mult_prob_error"] < 1.0001, "step 1 samples from the weights it trains"
    assert message.startswith(f"GRPO step {len(records) + 1}: token_mult_prob_error is "), message
    assert "beyond grpo.mismatch_guard.stop_token_mult_prob_error (1.01)" in message
    assert "a refit whose weights did not all land in the engine" in message
