"""The abstract interfaces plugins implement. Algorithms talk only to these.

Names load on first use (``from posttrain.interfaces import Policy`` imports
:mod:`posttrain.interfaces.policy`, and torch with it), so that a plugin's hook module can
import :class:`Command` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module of this package that defines it.
_MODULES = {
    "Algorithm": "algorithm",
    "Command": "command",
    "DataPlane": "data_plane",
    "PlaneSamples": "data_plane",
    "SampleMap": "data_plane",
    "WorkerPlaneHandle": "data_plane",
    "Environment": "environment",
    "EnvironmentReturn": "environment",
    "Message": "environment",
    "Generation": "generation",
    "RefitStats": "generation",
    "ROUTES_FIELD": "generation",
    "LossFunction": "loss",
    "LossType": "loss",
    "combine_metrics": "loss",
    "MetricSink": "metric_sink",
    "Policy": "policy",
    "RunContext": "context",
}
__all__ = [
    "Algorithm",
    "Command",
    "DataPlane",
    "Environment",
    "EnvironmentReturn",
    "Generation",
    "LossFunction",
    "LossType",
    "Message",
    "MetricSink",
    "PlaneSamples",
    "Policy",
    "ROUTES_FIELD",
    "RefitStats",
    "RunContext",
    "SampleMap",
    "WorkerPlaneHandle",
    "combine_metrics",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'posttrain.interfaces' has no attribute {name!r}")
    return getattr(importlib.import_module(f"posttrain.interfaces.{_MODULES[name]}"), name)


if TYPE_CHECKING:
    from posttrain.interfaces.algorithm import Algorithm
    from posttrain.interfaces.command import Command
    from posttrain.interfaces.context import RunContext
    from posttrain.interfaces.data_plane import DataPlane, PlaneSamples, SampleMap, WorkerPlaneHandle
    from posttrain.interfaces.environment import Environment, EnvironmentReturn, Message
    from posttrain.interfaces.generation import ROUTES_FIELD, Generation, RefitStats
    from posttrain.interfaces.loss import LossFunction, LossType, combine_metrics
    from posttrain.interfaces.metric_sink import MetricSink
    from posttrain.interfaces.policy import Policy
