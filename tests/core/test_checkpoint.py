"""Checkpoint manager: atomic saves, retention, resume discovery."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from posttrain.config import config_from_dict, dump_config
from posttrain.errors import CheckpointError
from posttrain.log import configure_logging
from posttrain.run.checkpoint import CheckpointManager, TrainingState, check_checkpoint_fits
from posttrain.run.context import RunContext, seed_everything
from posttrain.run.finished import finished_run, finished_unchanged
from posttrain.run.loop import LoopPlan, LoopSteps, RunEndedEarly, TrainingLoop
from posttrain.run.metrics import read_metrics
from tests.stand_ins import Numbers


def _writer(payload: str):
    def write(folder):
        (folder / "state.txt").write_text(payload)

    return write


def test_save_writes_complete_folder(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=None)
    path = manager.save(3, _writer("three"), metrics={"loss": 1.5}, config_yaml="seed: 1\n")
    assert path.name == "step_3"
    assert (path / "state.txt").read_text() == "three"
    assert (path / "config.yaml").read_text() == "seed: 1\n"
    assert manager.info(path) == {"step": 3, "metrics": {"loss": 1.5}}
    assert manager.latest() == path


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    """Kill a real process in the middle of writing step 2; step 1 stays the latest."""
    CheckpointManager(tmp_path).save(1, _writer("one"))
    script = textwrap.dedent(
        f"""
        import os
        from posttrain.run.checkpoint import CheckpointManager
        def write(folder):
            (folder / "state.txt").write_text("partial")
            os._exit(9)  # the process dies mid-save
        CheckpointManager({str(tmp_path)!r}).save(2, write)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == 9
    assert (tmp_path / "tmp_step_2").exists()  # the debris of the killed save
    manager = CheckpointManager(tmp_path)  # a new run starts
    assert not (tmp_path / "tmp_step_2").exists()
    assert manager.steps() == [1]
    assert (manager.latest() / "state.txt").read_text() == "one"


#: The calls through which a checkpoint save or deletion touches the file system.
FILE_SYSTEM_CALLS = ("mkdir", "rename", "replace", "unlink", "rmdir", "fsync")


def _save_steps_dying_at_call(directory: Path, crash_at: int, progress: Path) -> None:
    """In a forked child: SIGKILL itself at its ``crash_at``-th file-system call while it
    saves steps 1 to 4 (two checkpoints kept, so steps 1 and 2 are pruned), then saves step 4
    again as a run started over would. After each save returns, it records the save in
    ``progress``."""
    real_fsync = os.fsync
    calls = 0

    def dying(real):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    for name in FILE_SYSTEM_CALLS:
        setattr(os, name, dying(getattr(os, name)))

    def done(label: str) -> None:
        with open(progress, "a") as f:
            f.write(label + "\n")
            f.flush()
            real_fsync(f.fileno())

    def write(payload: str):
        def fill(folder: Path) -> None:
            (folder / "weights").write_text(payload)
            (folder / "optimizer").write_text(payload)

        return fill

    for step in range(1, 5):
        CheckpointManager(directory, keep_top_k=2).save(step, write(f"run 1 step {step}"))
        done(f"run 1 step {step}")
    CheckpointManager(directory, keep_top_k=2).save(4, write("run 2 step 4"))
    done("run 2 step 4")


def test_a_process_killed_at_any_file_system_call_of_a_save_leaves_complete_checkpoints(tmp_path):
    """Kill a real process at each of its file-system calls in turn, through saves, pruning
    and a step saved again: the next manager sees only complete checkpoints, the newest at
    least as new as the last save that returned, and no debris."""
    crash_at = 0
    while True:
        crash_at += 1
        directory, progress = tmp_path / f"crash_{crash_at}", tmp_path / f"crash_{crash_at}.progress"
        directory.mkdir()
        progress.touch()
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            try:
                _save_steps_dying_at_call(directory, crash_at, progress)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):  # past the last call: every crash point was tried
            break
        assert os.WTERMSIG(status) == signal.SIGKILL
        manager = CheckpointManager(directory, keep_top_k=2)  # the next run starts
        left = sorted(p.name for p in directory.iterdir())
        assert all(name.startswith("step_") for name in left), (crash_at, left)
        for step in manager.steps():
            folder = directory / f"step_{step}"
            payloads = {(folder / name).read_text() for name in ("weights", "optimizer")}
            assert payloads in ({f"run 1 step {step}"}, {f"run 2 step {step}"}), (crash_at, step, payloads)
            assert manager.info(folder)["step"] == step
        saved = progress.read_text().splitlines()
        if saved:  # the last save that returned is in place, or a newer one
            newest = manager.latest()
            assert newest is not None and manager.steps()[-1] >= int(saved[-1].split()[-1]), (crash_at, saved, left)
            if saved[-1] == "run 2 step 4":
                assert (newest / "weights").read_text() == "run 2 step 4"
    assert crash_at > 40, crash_at  # the scenario made at least that many calls


def test_exception_during_write_keeps_previous(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _writer("one"))

    def failing(folder):
        (folder / "state.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, failing)
    assert manager.steps() == [1]
    assert not (tmp_path / "tmp_step_2").exists()  # the partial folder is removed


def test_a_full_disk_during_a_checkpoint_says_so_and_removes_the_partial_folder(tmp_path, monkeypatch):
    """What a policy worker reports when the disk fills under torch.save: nothing about
    space. The free space left says it."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, _writer("x" * 3000))
    needed = sum(p.stat().st_size for p in (tmp_path / "step_1").rglob("*") if p.is_file())

    def fills_the_disk(folder):
        (folder / "state.txt").write_text("y" * 700)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 12, free=12))
    with pytest.raises(CheckpointError) as info:
        manager.save(2, fills_the_disk)
    assert str(info.value) == (
        f"checkpoint step 2 could not be written: the file system of {tmp_path} is full (12 bytes free); a "
        f"checkpoint of this run takes {needed / 1024:.1f} KiB (step_1). The partial folder tmp_step_2 was removed "
        f"and the previous checkpoint {tmp_path / 'step_1'} is intact. Free space there, point checkpointing.dir at "
        "a file system with room, or keep fewer checkpoints (checkpointing.keep_top_k); then run the same command "
        "again to resume. The error: RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 "
        "vs 598"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_an_error_saying_no_space_is_a_full_disk_whatever_the_free_space(tmp_path):
    def no_space(folder):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "policy"))

    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path).save(1, no_space)
    message = str(info.value)
    assert message.startswith(f"checkpoint step 1 could not be written: the file system of {tmp_path} is full (")
    assert "this checkpoint had written 0 bytes when it failed, and needs more" in message
    assert "no earlier checkpoint exists" in message and not (tmp_path / "tmp_step_1").exists()


def test_keep_top_k_by_metric_keeps_best_and_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="validation/accuracy")
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, 0.2)]:
        manager.save(step, _writer(str(step)), metrics={"validation/accuracy": acc})
    # best two are steps 2 (0.9) and 4 (0.7); step 5 is kept because it is the newest
    assert manager.steps() == [2, 4, 5]


def test_keep_top_k_lower_is_better(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=1, metric="loss", higher_is_better=False)
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0)]:
        manager.save(step, _writer(str(step)), metrics={"loss": loss})
    assert manager.steps() == [2, 3]


def test_keep_top_k_without_metric_keeps_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2)
    for step in range(1, 6):
        manager.save(step, _writer(str(step)))
    assert manager.steps() == [4, 5]


def test_info_of_incomplete_folder_is_refused(tmp_path):
    (tmp_path / "step_9").mkdir()
    with pytest.raises(CheckpointError, match="is not a complete checkpoint: training_info.json is missing"):
        CheckpointManager(tmp_path).info(tmp_path / "step_9")


def test_invalid_keep_top_k(tmp_path):
    with pytest.raises(CheckpointError, match="checkpointing.keep_top_k must be at least 1 or null, found 0"):
        CheckpointManager(tmp_path, keep_top_k=0)


def test_training_info_is_json(tmp_path):
    path = CheckpointManager(tmp_path).save(7, _writer("x"), metrics={"a": 1})
    assert json.loads((path / "training_info.json").read_text())["step"] == 7


# ----------------------------------------------------------------------------- config fit


def _model_folder(path, **shape):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 103, **shape}))
    return str(path)


def _config(model, **policy):
    return config_from_dict({"algorithm": "sft", "policy": {"model": model, **policy}})


def _saved_by(tmp_path, config):
    return CheckpointManager(tmp_path / "ckpt").save(1, _writer("x"), config_yaml=dump_config(config))


def test_a_checkpoint_of_the_same_config_fits(tmp_path):
    model = _model_folder(tmp_path / "m")
    folder = _saved_by(tmp_path, _config(model))
    check_checkpoint_fits(folder, _config(model, train_global_batch_size=16))  # batch size may change
    moved = _model_folder(tmp_path / "moved")  # same shape, another folder
    check_checkpoint_fits(folder, _config(moved))


def test_a_checkpoint_of_another_backend_algorithm_or_dtype_is_refused(tmp_path):
    model = _model_folder(tmp_path / "m")
    folder = _saved_by(tmp_path, _config(model))
    other = config_from_dict({"algorithm": "dpo", "policy": {"model": model, "backend": "megatron", "dtype": "bfloat16"}})
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_fits(folder, other)
    assert str(err.value) == (
        f"cannot resume from {folder}: it was written by a different config. Differences: "
        "algorithm: checkpoint 'sft', config 'dpo'; policy.backend: checkpoint 'dtensor', config 'megatron'; "
        "policy.dtype: checkpoint 'float32', config 'bfloat16'. Start the new run in another checkpointing.dir "
        "(or run_dir), or resume with the checkpoint's settings"
    )


def test_a_checkpoint_of_a_model_of_another_shape_is_refused(tmp_path):
    saved_model = _model_folder(tmp_path / "m")
    folder = _saved_by(tmp_path, _config(saved_model))
    wider = _model_folder(tmp_path / "wide", hidden_size=128)
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_fits(folder, _config(wider))
    assert str(err.value) == (
        f"cannot resume from {folder}: it was written by a different config. Differences: policy.model config.json "
        f"hidden_size: checkpoint 64 ({saved_model}), config 128 ({wider}). Start the new run in another "
        "checkpointing.dir (or run_dir), or resume with the checkpoint's settings"
    )


def test_a_run_refuses_a_checkpoint_of_another_config_before_ray_starts(tiny_model_path, tmp_path, monkeypatch):
    import posttrain.distributed.cluster as cluster
    from posttrain.run.context import run_algorithm

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the checkpoint was checked")

    monkeypatch.setattr(cluster, "init_ray", no_ray)
    tree = {"algorithm": "sft", "run_dir": str(tmp_path), "policy": {"model": tiny_model_path}}
    saved = CheckpointManager(tmp_path / "checkpoints").save(4, _writer("x"), config_yaml=dump_config(config_from_dict(tree)))
    with pytest.raises(CheckpointError) as err:
        run_algorithm(config_from_dict(tree, ["policy.dtype=bfloat16"]))
    assert str(err.value).startswith(
        f"cannot resume from {saved}: it was written by a different config. Differences: "
        "policy.dtype: checkpoint 'float32', config 'bfloat16'. "
    )


# ----------------------------------------------------------------------------- training state and the loop


class CounterPolicy:
    """A stand-in policy whose whole trained state is a counter, saved as a file."""

    def __init__(self) -> None:
        self.updates = 0
        self.exported: list[str] = []

    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path)
        (Path(path) / "updates").write_text(str(self.updates))

    def load_checkpoint(self, path: str) -> None:
        self.updates = int((Path(path) / "updates").read_text())

    def export_hf(self, path: str) -> None:
        self.exported.append(path)


def _loader(seed: int = 1):
    from posttrain.data import StatefulDataLoader

    return StatefulDataLoader(Numbers(10), 2, shuffle=True, seed=seed)


def test_training_state_writes_the_checkpoint_layout_and_restores_it(tmp_path):
    policy, loader = CounterPolicy(), _loader()
    next(iter(loader))
    policy.updates = 3
    TrainingState(policy, loader).save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataloader.pt", "policy", "rng.pt"]
    expected = (next(iter(loader))["value"].tolist(), random.random())

    restored, fresh = CounterPolicy(), _loader()
    TrainingState(restored, fresh).load(tmp_path, "sft")
    assert (next(iter(fresh))["value"].tolist(), random.random()) == expected
    assert restored.updates == 3


def test_training_state_refuses_a_folder_without_its_files_before_restoring_anything(tmp_path):
    (tmp_path / "dataloader.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        TrainingState(CounterPolicy(), _loader()).load(tmp_path, "sft")
    assert str(err.value) == (
        f"checkpoint {tmp_path} has no policy, rng.pt; it was not written by a sft run. "
        "Point checkpointing.dir at a sft run's checkpoints, or set checkpointing.resume=false"
    )


class CountingSteps(LoopSteps):
    """Steps whose metrics depend on the data position, the driver's random state and the
    policy's counter, so a resume that restored any of them wrongly logs other numbers.
    ``stop_in`` requests a stop (as SIGTERM would) while that step runs; ``abort_in`` raises
    KeyboardInterrupt as that step starts (as a second Ctrl-C does: no checkpoint)."""

    def __init__(self, context, policy, loader, stop_in: int | None = None, abort_in: int | None = None):
        self.context, self.policy, self.loader, self.stop_in, self.abort_in = context, policy, loader, stop_in, abort_in
        self.started_at: int | None = None
        self.validated: list[int] = []

    def start(self, step):
        self.started_at = step

    def train_step(self, step):
        if step == self.abort_in:
            raise KeyboardInterrupt("second stop signal")
        if self.loader.epoch >= 1:
            return None  # the data ran out
        batch = next(iter(self.loader))
        self.policy.updates += 1
        if step == self.stop_in:
            self.context.stop.request(signal.SIGTERM)
        return {"data": float(batch["value"].sum()), "noise": random.random(), "updates": float(self.policy.updates)}

    def validate(self, step):
        self.validated.append(step)
        return {"loss": 1.0 / (1 + step + self.policy.updates)}


def _plan(run_dir, total_steps: int) -> LoopPlan:
    return LoopPlan(label="sft", total_steps=total_steps, schedule_steps=total_steps, val_period=2,
                    val_at_start=True, val_at_end=True, export_dir=str(run_dir / "hf"), length_keys=("sft.max_num_steps",))


def _context(run_dir, tensorboard: bool = False, overrides: tuple[str, ...] = ()) -> RunContext:
    return RunContext(config_from_dict({
        "run_dir": str(run_dir), "logger": {"progress_bar": False, "tensorboard": tensorboard},
        "checkpointing": {"save_period": 2, "keep_top_k": None},
    }, list(overrides)))


def _run_loop(run_dir, total_steps: int, stop_in: int | None = None, abort_in: int | None = None, tensorboard: bool = False):
    seed_everything(0)
    context = _context(run_dir, tensorboard)
    policy, loader = CounterPolicy(), _loader()
    steps = CountingSteps(context, policy, loader, stop_in, abort_in)
    try:
        result = TrainingLoop(context, _plan(run_dir, total_steps), steps, TrainingState(policy, loader)).run()
    finally:
        context.close()
    return result, steps, policy


def _records(run_dir):
    return [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(run_dir / "metrics.jsonl")]


def _tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event in the run's TensorBoard files, by tag, as written (no purging of
    steps logged twice, which TensorBoard's own reader would otherwise hide)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=False)
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_the_loop_validates_saves_and_exports(tmp_path):
    result, steps, policy = _run_loop(tmp_path, total_steps=5)  # the data holds 5 batches
    records = _records(tmp_path)
    assert [(r["phase"], r["step"]) for r in records] == [
        ("validation", 0), ("train", 1), ("train", 2), ("validation", 2), ("train", 3), ("train", 4),
        ("validation", 4), ("train", 5), ("validation", 5),
    ]
    assert CheckpointManager(tmp_path / "checkpoints").steps() == [2, 4, 5]
    assert policy.exported == [str(tmp_path / "hf")] and steps.started_at == 0
    last_train, last_validation = records[-2], records[-1]
    assert result == {"step": 5, **{k: last_train[k] for k in ("data", "noise", "updates")},
                      "validation/loss": last_validation["loss"]}
    plan = {"total_steps": 5, "val_at_end": True, "export_dir": str(tmp_path / "hf")}
    info = json.loads((tmp_path / "checkpoints" / "step_4" / "training_info.json").read_text())
    assert info == {"step": 4, "validated_step": 4, "plan": plan,
                    "metrics": {**{k: records[5][k] for k in ("data", "noise", "updates")}, "validation/loss": records[6]["loss"]}}
    final = json.loads((tmp_path / "checkpoints" / "step_5" / "training_info.json").read_text())
    assert final["finished"] is True and final["plan"] == plan and final["validated_step"] == 5


def test_data_that_runs_out_before_the_planned_steps_stops_the_run_saying_why(tmp_path):
    """7 steps planned on 5 batches: step 6 cannot be filled. The 5 steps are checkpointed,
    nothing is exported or marked finished, and the run ends with an error (exit 2 from the
    command line) instead of passing for a finished one."""
    exported = []
    with pytest.raises(RunEndedEarly) as info, pytest.MonkeyPatch.context() as patch:
        patch.setattr(CounterPolicy, "export_hf", lambda self, path: exported.append(path))
        _run_loop(tmp_path, total_steps=7)
    assert str(info.value) == (
        "sft stopped after step 5 of 7: the training data ran out before step 6 could be filled. Nothing was "
        f"exported; the checkpoint {tmp_path / 'checkpoints' / 'step_5'} holds step 5; the run resumes from it when "
        "started again."
    )
    assert [(r["phase"], r["step"]) for r in _records(tmp_path)] == [
        ("validation", 0), ("train", 1), ("train", 2), ("validation", 2), ("train", 3), ("train", 4),
        ("validation", 4), ("train", 5),
    ]
    assert CheckpointManager(tmp_path / "checkpoints").steps() == [2, 4, 5]
    assert exported == []
    assert "finished" not in json.loads((tmp_path / "checkpoints" / "step_5" / "training_info.json").read_text())


def test_a_stopped_loop_saves_its_last_step_and_a_resumed_one_continues_it_exactly(tmp_path):
    _run_loop(tmp_path / "full", total_steps=5)
    result, steps, policy = _run_loop(tmp_path / "run", total_steps=5, stop_in=3)
    assert result["step"] == 3 and policy.exported == []  # no end-of-run validation, no export
    assert [(r["phase"], r["step"]) for r in _records(tmp_path / "run")][-2:] == [("validation", 2), ("train", 3)]
    assert CheckpointManager(tmp_path / "run" / "checkpoints").steps() == [2, 3]
    assert "finished" not in json.loads((tmp_path / "run" / "checkpoints" / "step_3" / "training_info.json").read_text())

    result, steps, policy = _run_loop(tmp_path / "run", total_steps=5)
    assert steps.started_at == 3 and policy.exported == [str(tmp_path / "run" / "hf")]
    assert _records(tmp_path / "run") == _records(tmp_path / "full")


def test_steps_logged_after_the_last_checkpoint_are_logged_once_after_resuming(tmp_path):
    """A run aborted without a checkpoint (a second Ctrl-C, a dead worker) after it logged
    step 3 resumes from step 2: its metrics.jsonl and TensorBoard files hold each step once,
    equal to an uninterrupted run's."""
    pytest.importorskip("tensorboard")
    _run_loop(tmp_path / "full", total_steps=5, tensorboard=True)
    with pytest.raises(KeyboardInterrupt):
        _run_loop(tmp_path / "run", total_steps=5, abort_in=4, tensorboard=True)
    assert [r["step"] for r in _records(tmp_path / "run") if r["phase"] == "train"] == [1, 2, 3]
    assert CheckpointManager(tmp_path / "run" / "checkpoints").steps() == [2]

    _run_loop(tmp_path / "run", total_steps=5, tensorboard=True)
    assert _records(tmp_path / "run") == _records(tmp_path / "full")
    scalars, expected = _tensorboard_scalars(tmp_path / "run"), _tensorboard_scalars(tmp_path / "full")
    assert scalars["train/updates"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
    assert scalars == expected
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1  # the stopped run's file was folded in


def test_a_fresh_run_replaces_the_records_an_earlier_run_left_in_its_run_dir(tmp_path):
    _run_loop(tmp_path / "full", total_steps=5)
    with pytest.raises(KeyboardInterrupt):
        _run_loop(tmp_path / "run", total_steps=5, abort_in=2)  # no checkpoint yet: the next run is fresh
    _run_loop(tmp_path / "run", total_steps=5)
    assert _records(tmp_path / "run") == _records(tmp_path / "full")


def test_a_resume_at_the_last_step_validates_only_if_that_step_was_not(tmp_path):
    _run_loop(tmp_path / "full", total_steps=4)
    _run_loop(tmp_path / "run", total_steps=4, stop_in=4)  # step 4 saved, its validation (val_period 2) done
    _, steps, policy = _run_loop(tmp_path / "run", total_steps=4)
    assert steps.validated == [] and policy.exported == [str(tmp_path / "run" / "hf")]
    assert _records(tmp_path / "run") == _records(tmp_path / "full")


def test_a_finished_run_started_again_says_so_without_running(tmp_path, capsys):
    configure_logging()  # events to stderr, as `posttrain run` routes them (unconfigured structlog prints to stdout)
    result, _, _ = _run_loop(tmp_path, total_steps=4)
    context = _context(tmp_path)
    try:
        assert finished_unchanged(context) == result  # the same config: known before any data is read
        assert finished_run(context, _plan(tmp_path, total_steps=4)) == result
        assert finished_run(context, _plan(tmp_path, total_steps=6)) is None  # a longer plan goes on
    finally:
        context.close()
    changed = _context(tmp_path, overrides=("logger.level=debug",))
    try:
        assert finished_unchanged(changed) is None  # another config: the plan decides, once read from the data
        assert finished_run(changed, _plan(tmp_path, total_steps=4)) == result
    finally:
        changed.close()
    fresh = _context(tmp_path, overrides=("checkpointing.resume=false",))
    try:
        assert finished_unchanged(fresh) is None and finished_run(fresh, _plan(tmp_path, total_steps=4)) is None
    finally:
        fresh.close()
    step_4 = tmp_path / "checkpoints" / "step_4"
    assert (
        f"the run already finished: it completed at step 4 (checkpoint {step_4}), so there is nothing to do. "
        "To train longer, raise sft.max_num_steps; to start over, set checkpointing.resume=false or use another run_dir"
    ) in capsys.readouterr().err


def test_a_run_stopped_at_its_last_step_is_not_finished(tmp_path):
    _run_loop(tmp_path, total_steps=4, stop_in=4)  # saved step 4, skipped the final validation and the export
    context = _context(tmp_path)
    try:
        assert finished_unchanged(context) is None and finished_run(context, _plan(tmp_path, total_steps=4)) is None
    finally:
        context.close()
