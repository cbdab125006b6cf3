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

The two file sinks also :meth:`rewind` (:class:`~posttrain.run.metrics.RewindableSink`): a run
resumed from checkpoint step N drops the records of later steps that a stopped run wrote
after saving it (and a fresh run drops every earlier record), so each phase's step is on
file once, as an uninterrupted run writes it. wandb and MLflow start a new remote run each
time, so they have nothing to rewind.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from posttrain.config.requirements import Requirement
from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig


class JsonlSink:
    """Appends one JSON line per call to ``path`` (line-buffered: a killed run keeps its lines)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> JsonlSink | None:
        return cls(run_dir / "metrics.jsonl") if config.logger.jsonl else None

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        record = {"step": step, "phase": phase, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def rewind(self, step: int | None) -> int:
        """Rewrite the file with the records of steps up to ``step`` only (none when None),
        the last one of each phase and step where an earlier run wrote it twice, and a torn
        last line left out. Returns how many lines were dropped. The file is replaced in one
        rename, so a crash leaves either the old or the new file."""
        self._file.close()
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        keyed = [(key, line) for line in lines if (key := _record_key(line)) is not None]
        kept = _latest_per_key(keyed, step)
        if len(kept) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)
        return len(lines) - len(kept)

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars as TensorBoard events under ``log_dir`` (one event file per run, opened at its
    first record)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "logger.tensorboard is true but tensorboard is not installed; "
                "pip install 'posttrain[tensorboard]' or set logger.tensorboard=false"
            ) from exc
        self.log_dir = log_dir
        self._writer_class = SummaryWriter
        self._writer: Any = None

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> TensorBoardSink | None:
        return cls(run_dir / "tensorboard") if config.logger.tensorboard else None

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        writer = self._open()
        for name, value in metrics.items():
            writer.add_scalar(f"{phase}/{name}", value, step)

    def rewind(self, step: int | None) -> int:
        """Replace the event files under ``log_dir`` with one holding the scalar events of
        steps up to ``step`` only (none when None), the last one of each tag and step where
        an earlier run wrote it twice. Returns how many events were dropped. The new file is
        flushed before the old ones are deleted."""
        # the events as written (EventFileLoader would turn their scalars into tensors)
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

        self.close()
        files = sorted(self.log_dir.glob("events.out.tfevents.*"))
        events = [event for file in files for event in LegacyEventFileLoader(str(file)).Load() if event.HasField("summary")]
        kept = _latest_per_key((((tuple(v.tag for v in e.summary.value), e.step), e) for e in events), step)
        if not files:
            return 0
        if kept:
            writer = self._open()
            for event in kept:
                writer.file_writer.add_event(event, step=event.step, walltime=event.wall_time)
            writer.flush()
        for file in files:
            file.unlink()
        return len(events) - len(kept)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self) -> Any:
        if self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.log_dir))
        return self._writer


def require_client(config: RunConfig, key: str, module: str) -> None:
    """Refuse ``key`` (a sink switched on) when its client package ``module`` is missing,
    naming the install command; the run has started nothing yet."""
    from posttrain.config.validate import where_set

    problem = Requirement(module, f"pip install {module}").problem()
    if problem is not None:
        raise ConfigError(
            f"{key} is true, but {problem} in this environment ({sys.executable}); nothing was started. Install it "
            f"with: pip install {module}, or set {key}: false.{where_set(config, key)}"
        )


class WandbSink:
    def __init__(self, project: str, run_dir: Path, config: Mapping[str, Any]):
        import wandb

        self._run = wandb.init(project=project, dir=str(run_dir), config=dict(config))

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> WandbSink | None:
        if not config.logger.wandb:
            return None
        require_client(config, "logger.wandb", "wandb")
        return cls(config.logger.wandb_project, run_dir, config.raw)

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        self._run.log({f"{phase}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, experiment: str):
        import mlflow

        self._mlflow = mlflow
        mlflow.set_experiment(experiment)
        mlflow.start_run()

    @classmethod
    def from_config(cls, config: RunConfig, run_dir: Path) -> MlflowSink | None:
        if not config.logger.mlflow:
            return None
        require_client(config, "logger.mlflow", "mlflow")
        return cls(config.logger.mlflow_experiment)

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        self._mlflow.log_metrics({f"{phase}/{k}".replace(":", "_"): float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def _latest_per_key(items: Iterable[tuple[tuple[K, int], T]], step: int | None) -> list[T]:
    """The items whose key's step is at most ``step`` (none when None), the last of each key,
    in the order of those last ones. A key is ``(what, step)``."""
    last: dict[tuple[K, int], int] = {}
    listed = list(items)
    for index, (key, _) in enumerate(listed):
        if step is not None and key[1] <= step:
            last[key] = index
    return [listed[index][1] for index in sorted(last.values())]


def _record_key(line: str) -> tuple[str, int] | None:
    """``(phase, step)`` of a ``metrics.jsonl`` line; None for a line that is not a record (a
    torn last line of a killed run)."""
    try:
        record = json.loads(line)
        return (str(record["phase"]), int(record["step"]))
    except (ValueError, KeyError, TypeError):
        return None


def _jsonable(value: float) -> float | str:
    value = float(value)
    return value if math.isfinite(value) else str(value)
