"""Metric sinks and structured logging."""

from __future__ import annotations

import json

import pytest

from posttrain.config.schema import LoggerConfig
from posttrain.errors import ConfigError
from posttrain.log import configure_logging, get_logger
from posttrain.run.metrics import MetricLogger, read_metrics


def test_jsonl_sink_records_every_step(tmp_path):
    logger = MetricLogger(LoggerConfig(), tmp_path)
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
    logger = MetricLogger(LoggerConfig(tensorboard=True), tmp_path)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_enabled_sink_without_package_is_a_config_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ConfigError, match="logger.wandb is true but wandb is not installed"):
        MetricLogger(LoggerConfig(wandb=True), tmp_path)


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
