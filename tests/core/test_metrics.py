"""Metric sinks and structured logging."""

from __future__ import annotations

import json
import sys

import pytest

from posttrain import __version__
from posttrain.config.schema import LoggerConfig, RunConfig
from posttrain.errors import ConfigError
from posttrain.log import configure_logging, get_logger
from posttrain.plugins import plugin_host
from posttrain.run.metrics import MetricLogger, read_metrics


def open_logger(tmp_path, **logger):
    return MetricLogger.open(RunConfig(logger=LoggerConfig(**logger)), tmp_path)


def test_jsonl_sink_records_every_step(tmp_path):
    logger = open_logger(tmp_path)
    logger.log(1, {"loss": 2.0, "reward": 0.25})
    logger.log(1, {"accuracy": 0.5}, phase="validation")
    logger.log(2, {"loss": float("nan")})
    logger.close()
    train = read_metrics(tmp_path / "metrics.jsonl", phase="train")
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["loss"] == 2.0 and train[0]["reward"] == 0.25
    assert train[1]["loss"] == "nan"  # non-finite values stay valid JSON
    assert read_metrics(tmp_path / "metrics.jsonl", phase="validation")[0]["accuracy"] == 0.5


def test_tensorboard_sink_writes_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    logger = open_logger(tmp_path, tensorboard=True)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_rewinding_keeps_each_phase_and_step_once_up_to_the_resumed_step(tmp_path):
    """What a resumed run's rewind leaves of a file an older posttrain wrote twice over
    (steps 3-4 logged, then again after a resume from step 2) with a torn last line."""
    logger = open_logger(tmp_path, tensorboard=True)
    for step, loss in [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (3, 30.0), (4, 40.0), (5, 50.0)]:
        logger.log(step, {"loss": loss})
    logger.log(4, {"accuracy": 0.5}, phase="validation")
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "pha')  # a run killed mid-line

    logger = open_logger(tmp_path, tensorboard=True)
    logger.rewind(4)
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["phase"], r["step"], r.get("loss", r.get("accuracy"))) for r in records] == [
        ("train", 1, 1.0), ("train", 2, 2.0), ("train", 3, 30.0), ("train", 4, 40.0), ("validation", 4, 0.5),
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), purge_orphaned_data=False)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [(e.step, e.value) for e in events.Scalars("validation/accuracy")] == [(4, 0.5)]

    logger = open_logger(tmp_path, tensorboard=True)
    logger.rewind(None)  # a fresh run in the same run_dir
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    assert list((tmp_path / "tensorboard").iterdir()) == []


def test_core_registers_its_sinks_as_a_plugin_and_the_logger_keys_turn_them_on(tmp_path):
    sinks = plugin_host().metric_sinks
    core = {name: sinks.distribution_of(name) for name in ("jsonl", "tensorboard", "wandb", "mlflow")}
    assert set(core.values()) == {f"posttrain {__version__}"}
    on = open_logger(tmp_path / "on")
    assert [type(sink).__name__ for sink in on.sinks] == ["JsonlSink"]  # the defaults: metrics.jsonl only
    on.close()
    assert open_logger(tmp_path / "off", jsonl=False).sinks == []
    assert not (tmp_path / "off").exists()


def test_a_sink_that_cannot_open_closes_the_sinks_opened_before_it(tmp_path, monkeypatch):
    from posttrain.builtin.sinks import JsonlSink

    closed = []
    monkeypatch.setattr(JsonlSink, "close", lambda self: closed.append(type(self).__name__))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match="logger.wandb is true, but the Python package 'wandb' is not installed"):
        open_logger(tmp_path, wandb=True)
    assert closed == ["JsonlSink"]


def test_structlog_events_go_to_json_file(tmp_path):
    events = tmp_path / "events.jsonl"
    configure_logging("info", events)
    get_logger().info("step done", step=3, reward=0.5)
    get_logger().debug("hidden")
    configure_logging("info", None)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines == [{"step": 3, "reward": 0.5, "event": "step done", "level": "info", "timestamp": lines[0]["timestamp"]}]
    with pytest.raises(ValueError, match="logger.level: expected one of debug, info, warning, error; found 'loud'"):
        configure_logging("loud")
