"""The abstract interfaces plugins implement. Algorithms talk only to these."""

from posttrain.interfaces.algorithm import Algorithm
from posttrain.interfaces.data_plane import DataPlane, PlaneSamples, SampleMap, WorkerPlaneHandle
from posttrain.interfaces.environment import Environment, EnvironmentReturn, Message
from posttrain.interfaces.generation import Generation, RefitStats
from posttrain.interfaces.loss import LossFunction, LossType, combine_metrics
from posttrain.interfaces.metric_sink import MetricSink
from posttrain.interfaces.policy import Policy

__all__ = [
    "Algorithm",
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
    "RefitStats",
    "SampleMap",
    "WorkerPlaneHandle",
    "combine_metrics",
]
