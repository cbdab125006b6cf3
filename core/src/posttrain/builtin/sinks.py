"""Core's metric sinks, registered by core's plugin (``posttrain_metric_sinks``) like any
third-party sink and turned on by the ``logger`` section:

- ``jsonl`` (``logger.jsonl``, on by default): ``<run_dir>/metrics.jsonl``, one line per
  call, ``{"step": N, "phase": "train"|"validation", "time": unix_s, <name>: value...}``;
  non-finite values are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``.
- ``tensorboard`` (``logger.tensorboard``): ``<run_dir>/tensorboard``, tags ``<phase>/<name>``.
- ``wandb`` (``logger.wandb``, project ``logger.wandb_project``): keys ``<phase>/<name>``.
- ``mlflow`` (``logger.mlflow``, experiment ``logger.mlflow_experiment``): keys
  ``<phase>/<name>`` with ``:`` replaced by ``_``.

Each sink's ``from_config`` is its registered factory: the sink opened for the run, or None
when its ``logger`` key is off. A sink whose library is missing raises
:class:`~posttrain.errors.ConfigError` naming the key and the install.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig


class JsonlSink:
    """Appends one JSON line per call to ``path`` (line-buffered: a killed run keeps its lines)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> JsonlSink | None:
        return cls(run_dir / "metrics.jsonl") if config.logger.jsonl else None

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

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> TensorBoardSink | None:
        return cls(run_dir / "tensorboard") if config.logger.tensorboard else None

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

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> WandbSink | None:
        return cls(config.logger.wandb_project, run_dir, config.raw) if config.logger.wandb else None

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

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> MlflowSink | None:
        return cls(config.logger.mlflow_experiment) if config.logger.mlflow else None

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        self._mlflow.log_metrics({f"{phase}/{k}".replace(":", "_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _jsonable(value: float) -> float | str:
    value = float(value)
    return value if math.isfinite(value) else str(value)
