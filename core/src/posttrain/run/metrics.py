"""A run's metrics: the logger that fans them out to the metric sinks, reading
``metrics.jsonl`` back, how the results of several policy passes combine, and the progress
bar.

The sinks are plugins (``posttrain_metric_sinks``, :mod:`posttrain.hookspecs`); core's own,
``metrics.jsonl`` among them, are in :mod:`posttrain.builtin.sinks`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from posttrain.log import get_logger
from posttrain.plugins import PluginHost, plugin_host

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.interfaces.metric_sink import MetricSink


@runtime_checkable
class RewindableSink(Protocol):
    """A metric sink that keeps its records in the run's folder and can take back those a
    stopped run wrote after its last checkpoint (core's ``metrics.jsonl`` and TensorBoard
    sinks). A sink without :meth:`rewind` is written to as it is."""

    def rewind(self, step: int | None) -> int:
        """Keep only the records of steps up to ``step`` (a resumed run's checkpoint step;
        None: a fresh run, keep none), at most one per phase and step; return how many
        records were dropped. Called once, before the run's first record."""
        ...


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

    def rewind(self, step: int | None) -> None:
        """Make the sinks' records those of a run that has done ``step`` steps, as the loop
        starts: a run resumed from checkpoint step N drops what a stopped run logged after
        step N (it logs those steps again), a fresh run (None) drops every earlier record of
        its ``run_dir``. Each sink that can (:class:`RewindableSink`) does it; each drop is
        logged."""
        for sink in self.sinks:
            if isinstance(sink, RewindableSink):
                dropped = sink.rewind(step)
                if dropped:
                    get_logger().info(
                        "earlier metric records dropped" if step is None else f"metric records after step {step} dropped",
                        sink=type(sink).__name__,
                        records=dropped,
                    )

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


#: Metrics of ``Policy.train`` that describe the pass (learning rate, gradient norm, loss
#: tokens, seconds), not the loss.
PASS_METRICS = ("lr", "num_tokens", "step_time_s", "grad_norm")


def combine_train_passes(parts: Sequence[Mapping[str, float]], reductions: Mapping[str, str]) -> dict[str, float]:
    """The metrics of one algorithm step that ran several ``Policy.train`` calls (one per
    global batch): ``num_tokens`` and ``step_time_s`` add up, names in ``reductions`` (the
    loss's ``metric_reductions``) take their max or min, everything else (each call's value
    is normalised over its own global batch) is averaged."""
    from posttrain.interfaces.loss import combine_metrics  # torch: only when a run combines

    return combine_metrics(parts, {"num_tokens": "sum", "step_time_s": "sum", **reductions}, default="mean")


def read_metrics(path: str | Path, phase: str | None = None) -> list[dict[str, Any]]:
    """Read a run's ``metrics.jsonl`` (optionally one phase), in file order."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if phase is None or r["phase"] == phase]


class StageTimer:
    """Wall-clock seconds per named stage; ``with timer("generation"): ...`` adds to it.
    ``stages`` start at 0 s, so that they are reported even when never entered."""

    def __init__(self, *stages: str) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``timing/<stage>`` in seconds."""
        return {f"timing/{stage}": seconds for stage, seconds in self.seconds.items()}


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

