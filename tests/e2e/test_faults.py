"""Faults during whole SFT runs on the dtensor backend, and what the run does about them.

- a policy worker killed mid-run (SIGKILL, as the OOM killer does) stops the run within
  seconds with an error naming the worker group and rank; the checkpoint before it stays
  intact, and running again resumes from it to the uninterrupted run's metrics;
- SIGTERM mid-run finishes the step, checkpoints it and stops; running again resumes to the
  uninterrupted run's metrics (SFT; GRPO in a slow test);
- a second stop signal (no checkpoint) after step 3, then a resume from step 2: metrics.jsonl
  and the TensorBoard files hold each step once, equal to the uninterrupted run's;
- through ``posttrain run``: Ctrl-C during start-up exits within seconds saying no step ran,
  leaving no process behind; (slow) a finished run started again says so, exit 0, without
  reading data or starting Ray; the faults above (SIGTERM to the process, Ctrl-C to its
  process group) as a user sees them: the exit status, the message, and no Ray process left
  behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from posttrain import hookimpl
from posttrain.config import config_from_dict
from posttrain.errors import RunStopped, WorkerError
from posttrain.plugins import new_plugin_host
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
#: Metrics that measure time, not what was computed (``time``: when the record was written).
TIMING = ("time", "step_time_s", "tokens_per_s", "time_s")
#: Seconds from Ctrl-C during start-up to the CLI's exit: 12.7 s measured before the fix,
#: 2.0 s after it on the idle 2-core machine; the margin is for a loaded CI machine.
STOP_DURING_START_UP_S = 8
WORKER_CLASS = "DTensorPolicyWorker"


def write_corpus(path: Path, rows: int) -> str:
    """Four random letters answered reversed."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            word = "".join(rng.choices(string.ascii_lowercase, k=4))
            f.write(json.dumps({"messages": [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]}) + "\n")
    return str(path)


def sft_config(model: str, train: str, run_dir: Path, save_period: int = 2, in_driver: bool | None = None):
    """The faults' SFT run: checkpoints every ``save_period`` steps, metrics to
    metrics.jsonl and TensorBoard; ``in_driver``: ``policy.in_driver`` (false: a worker
    process to kill)."""
    return config_from_dict({
        "algorithm": "sft",
        "seed": 0,
        "run_dir": str(run_dir),
        "policy": {
            "model": model,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 8,
            "max_total_sequence_length": 64,
            "optimizer": {"name": "adamw", "lr": 3e-3},
            "resources": {"cpus": 1},
            "in_driver": in_driver,
        },
        "data": {"train": train},
        "logger": {"progress_bar": False, "tensorboard": True},
        "checkpointing": {"save_period": save_period, "keep_top_k": None},
        "sft": {"max_num_steps": STEPS},
    })


def train_metrics(run_dir: Path) -> dict[int, dict]:
    """Each step's last logged training metrics, without timings (a step logged before a
    fault and again after resuming counts once, as resumed)."""
    return {
        r["step"]: {k: v for k, v in r.items() if k != "phase" and k not in TIMING}
        for r in read_metrics(run_dir / "metrics.jsonl", "train")
    }


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event of the run's TensorBoard files, by tag, without timings, as written
    (no purging of steps logged twice, which TensorBoard's own reader would otherwise hide)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=False)
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.split("/", 1)[1] not in TIMING
    }


def checkpoint_steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def policy_workers() -> list[psutil.Process]:
    """This process's live policy worker actors (Ray runs them under the raylet we started)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if WORKER_CLASS in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


class AtTrainStep:
    """A plugin that runs ``action`` once, right after training step ``step`` is logged."""

    def __init__(self, step: int, action: Callable[[], None]):
        self.step, self.action, self.fired_at = step, action, None

    @hookimpl
    def posttrain_step_end(self, step, metrics, phase):
        if phase == "train" and step == self.step and self.fired_at is None:
            self.fired_at = time.monotonic()
            self.action()


def with_plugin(plugin: object):
    host = new_plugin_host()
    host.register(plugin, name="fault")
    return host


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("faults") / "train.jsonl", 8 * STEPS)


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_model_path, corpus, ray_cluster, tmp_path_factory) -> Path:
    """The run_dir of the SFT run with no fault."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_algorithm(sft_config(tiny_model_path, corpus, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> dict[int, dict]:
    metrics = train_metrics(uninterrupted_run)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    return metrics


def assert_same_metrics(found: dict[int, dict], expected: dict[int, dict]) -> None:
    """Bit-identical: a resumed run restores weights, optimizer, data position and RNG exactly."""
    assert sorted(found) == sorted(expected)
    for step, values in expected.items():
        assert found[step].keys() == values.keys()
        assert found[step] == values, step


def test_a_killed_worker_stops_the_run_naming_it_and_resume_matches(tiny_model_path, corpus, uninterrupted, tmp_path):
    def kill_worker():
        (worker,) = policy_workers()
        worker.kill()  # SIGKILL

    killer = AtTrainStep(3, kill_worker)  # after step 3; step_2 is the last checkpoint
    config = sft_config(tiny_model_path, corpus, tmp_path, in_driver=False)  # resumed against a run in the driver
    with pytest.raises(WorkerError) as failure:
        run_algorithm(config, with_plugin(killer))
    stopped_after = time.monotonic() - killer.fired_at
    assert stopped_after < 30, f"the run took {stopped_after:.1f} s to notice the dead worker"
    assert str(failure.value).startswith("worker group 'policy' rank 0 died on node ")
    assert checkpoint_steps(tmp_path) == ["step_2"]
    assert not policy_workers()  # the run shut its worker group down

    result = run_algorithm(config)
    assert result["step"] == STEPS
    assert_same_metrics(train_metrics(tmp_path), uninterrupted)


def test_sigterm_checkpoints_the_finished_step_and_resume_matches(tiny_model_path, corpus, uninterrupted, tmp_path):
    term = AtTrainStep(3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    config = sft_config(tiny_model_path, corpus, tmp_path)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped) as stopped:
        run_algorithm(config, with_plugin(term))
    step_3 = tmp_path / "checkpoints" / "step_3"
    assert str(stopped.value) == f"stopped by SIGTERM after step 3; the run resumes from the checkpoint {step_3} when started again"
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert checkpoint_steps(tmp_path) == ["step_2", "step_3"]  # no step 4 was started
    assert sorted(train_metrics(tmp_path)) == [1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is gone

    result = run_algorithm(config)
    assert result["step"] == STEPS
    assert_same_metrics(train_metrics(tmp_path), uninterrupted)


def test_after_a_second_stop_signal_the_resumed_run_logs_each_step_once(
    tiny_model_path, corpus, uninterrupted, uninterrupted_run, tmp_path
):
    """A second SIGTERM stops at once, without a checkpoint, after step 3 was logged (the
    last checkpoint is step 2): the resumed run takes step 3's records back and logs steps
    3-6 once, in metrics.jsonl and in TensorBoard, as the uninterrupted run did."""

    def twice():
        os.kill(os.getpid(), signal.SIGTERM)  # asks for a stop at the step boundary
        os.kill(os.getpid(), signal.SIGTERM)  # gives up on it: KeyboardInterrupt, no checkpoint

    config = sft_config(tiny_model_path, corpus, tmp_path)
    with pytest.raises(KeyboardInterrupt, match="second stop signal"):
        run_algorithm(config, with_plugin(AtTrainStep(3, twice)))
    assert checkpoint_steps(tmp_path) == ["step_2"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")] == [1, 2, 3]

    run_algorithm(config)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["phase"], r["step"]) for r in records] == [("train", step) for step in range(1, STEPS + 1)]
    assert_same_metrics(train_metrics(tmp_path), uninterrupted)
    scalars = tensorboard_scalars(tmp_path)
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, STEPS + 1))
    assert scalars == tensorboard_scalars(uninterrupted_run)


@pytest.mark.slow
def test_grpo_sigterm_checkpoints_the_finished_step_and_resume_matches(tiny_model_path, ray_cluster, tmp_path):
    from posttrain_grpo.config import GRPOConfig
    from tests.e2e.test_grpo_e2e import make_config, seven_rows, write_rows

    train = write_rows(tmp_path / "train.jsonl", seven_rows(16))
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=3)
    run_algorithm(make_config(tiny_model_path, tmp_path / "full", train, grpo))
    config = make_config(tiny_model_path, tmp_path / "run", train, grpo)
    with pytest.raises(RunStopped) as stopped:
        run_algorithm(config, with_plugin(AtTrainStep(1, lambda: os.kill(os.getpid(), signal.SIGTERM))))
    assert stopped.value.step == 1 and checkpoint_steps(tmp_path / "run") == ["step_1"]
    run_algorithm(config)

    timing = ("timing/", "throughput/", "refit/seconds")
    untimed = {step: {k: v for k, v in r.items() if not k.startswith(timing)} for step, r in train_metrics(tmp_path / "run").items()}
    expected = {step: {k: v for k, v in r.items() if not k.startswith(timing)} for step, r in train_metrics(tmp_path / "full").items()}
    assert_same_metrics(untimed, expected)


# ----------------------------------------------------------------------------- through the CLI


def cli_command(model: str, train: str, run_dir: Path, steps: int = 1000, in_driver: bool | None = False) -> list[str]:
    """``posttrain run sft``, by default with a policy worker process of its own (to kill,
    and to find gone after the run); ``in_driver``: ``policy.in_driver``."""
    return [
        sys.executable, "-m", "posttrain.cli", "run", "sft", "--config", "examples/configs/sft.yaml",
        f"policy.model={model}", f"run_dir={run_dir}", f"data.train={train}", "data.validation=null",
        f"sft.max_num_steps={steps}", "sft.max_num_epochs=1000", "sft.export_dir=null", "sft.val_at_end=false",
        "checkpointing.save_period=2", "checkpointing.keep_top_k=null", "logger.progress_bar=false",
        f"policy.in_driver={'null' if in_driver is None else str(in_driver).lower()}",
    ]


def start_cli(command: list[str], *, own_group: bool = False) -> subprocess.Popen:
    """``command`` in a cluster of its own (not the test session's); ``own_group``: in a new
    process group, as a shell runs a foreground job."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=own_group
    )


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.2)


def logged_steps(run_dir: Path) -> int:
    file = run_dir / "metrics.jsonl"
    return len(read_metrics(file, "train")) if file.exists() else 0


def test_cli_ctrl_c_during_start_up_stops_at_once_saying_no_step_ran(tiny_model_path, corpus, tmp_path):
    """Ctrl-C while the workers start: exit 130 within seconds, nothing trained or saved, no
    Ray process left (the workers being started are stopped, none further starts)."""
    run_dir = tmp_path / "run"
    proc = start_cli(cli_command(tiny_model_path, corpus, run_dir), own_group=True)
    events = run_dir / "events.jsonl"
    wait_for(lambda: events.exists() and "Ray started" in events.read_text(), proc, 120, "Ray's start")
    children = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - interrupted

    assert proc.returncode == 130, stderr[-3000:]
    assert took < STOP_DURING_START_UP_S, (took, stderr[-3000:])
    assert "stopped by SIGINT during start-up, before the first step; nothing was trained or saved" in stderr
    assert "finishing the current step" not in stderr and "workers started" not in events.read_text()
    assert logged_steps(run_dir) == 0 and not list(run_dir.glob("checkpoints/step_*"))
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "to_group", "in_driver"),
    # a scheduler's SIGTERM to a run with its policy in the driver (the default on CPUs); Ctrl-C reaches Ray's
    # processes too, a policy worker process among them
    [(signal.SIGTERM, False, None), (signal.SIGINT, True, False)],
    ids=["sigterm", "ctrl-c"],
)
def test_cli_stop_signal_saves_exits_128_plus_signal_and_leaves_no_ray_process(
    tiny_model_path, corpus, tmp_path, signum, to_group, in_driver
):
    run_dir = tmp_path / "run"
    proc = start_cli(cli_command(tiny_model_path, corpus, run_dir, in_driver=in_driver), own_group=to_group)
    wait_for(lambda: logged_steps(run_dir) >= 3, proc, 300, "third training step")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any(WORKER_CLASS in " ".join(p.cmdline()) for p in children) == (in_driver is False)
    if to_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 128 + signum, stderr[-3000:]
    last = max(train_metrics(run_dir))
    checkpoint = run_dir / "checkpoints" / f"step_{last}"
    assert f"stopped: stopped by {signum.name} after step {last}; the run resumes from the checkpoint {checkpoint}" in stderr
    assert (checkpoint / "training_info.json").is_file()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


@pytest.mark.slow
def test_cli_killed_worker_exits_within_30_s_and_the_same_command_resumes(tiny_model_path, tmp_path):
    train = write_corpus(tmp_path / "train.jsonl", 8 * STEPS)
    full_dir, run_dir = tmp_path / "full", tmp_path / "run"
    full = subprocess.run(cli_command(tiny_model_path, train, full_dir, steps=40), cwd=REPO, env={**os.environ, "RAY_ADDRESS": ""},
                          capture_output=True, text=True, timeout=400)
    assert full.returncode == 0, full.stderr[-3000:]

    command = cli_command(tiny_model_path, train, run_dir, steps=40)
    proc = start_cli(command)
    wait_for(lambda: (run_dir / "checkpoints" / "step_2").is_dir(), proc, 300, "checkpoint step_2")
    (worker,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if WORKER_CLASS in " ".join(p.cmdline())]
    worker.kill()
    killed = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - killed

    assert proc.returncode == 2 and took < 30, (proc.returncode, took, stderr[-3000:])
    assert "error: worker group 'policy' rank 0 died on node " in stderr
    resumed = start_cli(command)
    _, stderr = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resumed" in (run_dir / "events.jsonl").read_text()
    assert_same_metrics(train_metrics(run_dir), train_metrics(full_dir))

    again = subprocess.run(command, cwd=REPO, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the run already finished: it completed at step 40 (checkpoint {run_dir / 'checkpoints' / 'step_40'})" in again.stderr
    assert "Ray started" not in again.stderr and "data loaded" not in again.stderr  # returns before data and Ray
    assert_same_metrics(train_metrics(run_dir), train_metrics(full_dir))  # nothing logged twice
