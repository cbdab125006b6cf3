"""Checkpoint manager: atomic saves, retention, resume discovery."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from posttrain.config import config_from_dict, dump_config
from posttrain.errors import CheckpointError
from posttrain.run.checkpoint import CheckpointManager, check_checkpoint_fits


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


def test_exception_during_write_keeps_previous(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _writer("one"))

    def failing(folder):
        (folder / "state.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, failing)
    assert manager.steps() == [1]


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
