"""Metric sinks: where a run's scalar metrics go (a file, a dashboard, a tracking server).

A sink is opened for one run by the factory a plugin registers with the
``posttrain_metric_sinks`` hook (:mod:`posttrain.hookspecs`) and receives every training
step's and every validation pass's metrics, in the order they are logged, until the run
closes it. Core's own sinks (``metrics.jsonl``, TensorBoard, wandb, MLflow) are registered
the same way (:mod:`posttrain.builtin.sinks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class MetricSink(Protocol):
    """One run's destination for scalar metrics. Any object with these two methods is one."""

    def write(self, step: int, metrics: Mapping[str, float], phase: str) -> None:
        """Record ``metrics`` (plain floats, possibly NaN or infinite) of ``step``.

        ``phase`` is ``"train"`` (after training step ``step``, counted from 1) or
        ``"validation"`` (a validation pass after ``step`` steps; 0 before the first).
        ``metrics`` must not be mutated.
        """

    def close(self) -> None:
        """Flush and release what the sink holds; called once, when the run ends however it ends."""
