"""Core's own plugin, registered through the same ``posttrain`` entry point as any
third-party plugin: the in-memory data plane and the metric sinks of the ``logger`` section.
Imports stay lazy so ``posttrain plugins`` runs without torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.builtin.sinks import JsonlSink, MlflowSink, TensorBoardSink, WandbSink

if TYPE_CHECKING:
    from posttrain.hookspecs import DataPlaneFactory, MetricSinkFactory
    from posttrain.interfaces import DataPlane


def _memory_data_plane(config: Any) -> DataPlane:
    from posttrain.builtin.memory_plane import MemoryDataPlane

    return MemoryDataPlane()


@hookimpl
def posttrain_data_planes() -> Mapping[str, DataPlaneFactory]:
    return {"memory": _memory_data_plane}


@hookimpl
def posttrain_metric_sinks() -> Mapping[str, MetricSinkFactory]:
    return {
        "jsonl": JsonlSink.from_config,
        "tensorboard": TensorBoardSink.from_config,
        "wandb": WandbSink.from_config,
        "mlflow": MlflowSink.from_config,
    }
