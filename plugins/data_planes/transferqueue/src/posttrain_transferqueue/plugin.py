"""Hook implementations of posttrain-transferqueue: the ``transferqueue`` data plane and its
config section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config.schema import RunConfig
from posttrain_transferqueue.config import SECTION, TransferQueueConfig, check


def create_transferqueue_plane(config: RunConfig) -> Any:
    """The run driver's plane: connects Ray (``config.cluster``) when needed, starts or
    attaches to TransferQueue, and clears partitions an earlier crashed process of this run
    left behind."""
    from posttrain.distributed import init_ray
    from posttrain.distributed.cluster import joined_address
    from posttrain_transferqueue.plane import TransferQueueDataPlane, run_namespace

    init_ray(config.cluster)
    options = config.sections.get(SECTION) or TransferQueueConfig()
    namespace = options.namespace or run_namespace(config.run_dir)
    return TransferQueueDataPlane(options, namespace, exclusive=True, joined=joined_address(config.cluster))


@hookimpl
def posttrain_data_planes() -> Mapping[str, Any]:
    return {"transferqueue": create_transferqueue_plane}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {SECTION: TransferQueueConfig}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    if config.data_plane.backend != "transferqueue":
        return
    check(config.sections.get(SECTION) or TransferQueueConfig(), config)
