"""Run configuration: typed sections (:mod:`.schema`), the YAML loader (:mod:`.loader`),
the structurer (:mod:`.structure`) and cross-key validation (:mod:`.validate`)."""

from __future__ import annotations

from posttrain.config.loader import config_from_dict, dump_config, load_config
from posttrain.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DataPlaneConfig,
    DynamicBatchingConfig,
    GenerationConfig,
    LoggerConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    SchedulerConfig,
    SequencePackingConfig,
    WorkerResources,
)
from posttrain.config.validate import require_registered, validate_config, where_set

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DataPlaneConfig",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "LoggerConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "RunConfig",
    "SchedulerConfig",
    "SequencePackingConfig",
    "WorkerResources",
    "config_from_dict",
    "dump_config",
    "load_config",
    "require_registered",
    "validate_config",
    "where_set",
]
