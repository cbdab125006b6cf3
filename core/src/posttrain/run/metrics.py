"""Metric sinks and the progress bar.

:class:`MetricLogger` writes every step's scalars to ``<run_dir>/metrics.jsonl`` (always, unless
``logger.jsonl`` is off) and to TensorBoard, wandb and MLflow when enabled. Each line of the
JSONL file is ``{"step": N, "phase": "train"|"validation", "time": unix_s, <name>: value...}``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from posttrain.config.schema import LoggerConfig
from posttrain.errors import ConfigError


class Sink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        record = {"step": step, "phase": phase, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "logger.tensorboard is true but tensorboard is not installed; "
                "pip install 'posttrain[tensorboard]' or set logger.tensorboard=false"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(f"{phase}/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("logger.wandb is true but wandb is not installed; pip install wandb or set logger.wandb=false") from exc
        self._run = wandb.init(project=project, dir=str(run_dir), config=dict(config))

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        self._run.log({f"{phase}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, experiment: str):
        try:
            import mlflow
        except ImportError as exc:
            raise ConfigError("logger.mlflow is true but mlflow is not installed; pip install mlflow or set logger.mlflow=false") from exc
        self._mlflow = mlflow
        mlflow.set_experiment(experiment)
        mlflow.start_run()

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        self._mlflow.log_metrics({f"{phase}/{k}".replace(":", "_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


class MetricLogger:
    """Fans one step's scalar metrics out to every enabled sink."""

    def __init__(self, config: LoggerConfig, run_dir: str | Path, run_config: Mapping[str, Any] | None = None):
        run_dir = Path(run_dir)
        self.sinks: list[Sink] = []
        if config.jsonl:
            self.sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if config.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if config.wandb:
            self.sinks.append(WandbSink(config.wandb_project, run_dir, run_config or {}))
        if config.mlflow:
            self.sinks.append(MlflowSink(config.mlflow_experiment))

    def log(self, step: int, metrics: Mapping[str, float], phase: str = "train") -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) or _is_scalar_tensor(v)}
        for sink in self.sinks:
            sink.write(step, scalars, phase)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_metrics(path: str | Path, phase: str | None = None) -> list[dict[str, Any]]:
    """Read a run's ``metrics.jsonl`` (optionally one phase), in file order."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if phase is None or r["phase"] == phase]


class ProgressBar:
    """Steps done, ETA and the latest headline metrics, on one terminal line (tqdm)."""

    HEADLINE = ("reward", "loss", "accuracy")

    def __init__(self, total: int, description: str, enabled: bool = True, initial: int = 0):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, desc=description, disable=not enabled, dynamic_ncols=True, unit="step")

    def update(self, metrics: Mapping[str, float], steps: int = 1) -> None:
        shown = {k: f"{float(v):.4g}" for k, v in metrics.items() if k.rsplit("/", 1)[-1] in self.HEADLINE}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()


def _is_scalar_tensor(value: Any) -> bool:
    return hasattr(value, "numel") and value.numel() == 1


def _jsonable(value: float) -> float | str:
    value = float(value)
    return value if math.isfinite(value) else str(value)
