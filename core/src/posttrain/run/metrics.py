"""A run's metrics: the logger that fans them out to the metric sinks, reading
``metrics.jsonl`` back, and the progress bar.

The sinks are plugins (``posttrain_metric_sinks``, :mod:`posttrain.hookspecs`); core's own,
``metrics.jsonl`` among them, are in :mod:`posttrain.builtin.sinks`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.plugins import PluginHost, plugin_host

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.interfaces.metric_sink import MetricSink


class MetricLogger:
    """Fans one step's scalar metrics out to a run's sinks, in order."""

    def __init__(self, sinks: Sequence[MetricSink]):
        self.sinks = list(sinks)

    @classmethod
    def open(cls, config: RunConfig, run_dir: str | Path, host: PluginHost | None = None) -> MetricLogger:
        """Every sink registered with ``host`` (this process's host by default) that
        ``config`` turns on, opened for ``run_dir``, in the registry's (name) order. When one
        fails to open, those opened before it are closed and its error is raised."""
        registry = (host or plugin_host()).metric_sinks
        run_dir = Path(run_dir)
        sinks: list[MetricSink] = []
        try:
            for name in registry:
                sink = registry[name](config, run_dir)
                if sink is not None:
                    sinks.append(sink)
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    def log(self, step: int, metrics: Mapping[str, Any], phase: str = "train") -> None:
        """Write the scalar values of ``metrics`` (numbers and one-element tensors, as
        floats; anything else is left out) to every sink."""
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

