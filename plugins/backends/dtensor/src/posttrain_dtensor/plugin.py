"""Hook implementations of posttrain-dtensor: the ``dtensor`` policy backend and its
``policy.dtensor`` configuration section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain import hookimpl
from posttrain_dtensor.config import SECTION, DTensorConfig, validate_policy_config

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.distributed import VirtualCluster
    from posttrain.interfaces import Policy


def make_policy(config: RunConfig, cluster: VirtualCluster, *, name: str = "policy", reference: bool = True) -> Policy:
    """Factory of the ``dtensor`` backend: start the worker group ``name`` and load the model."""
    from posttrain_dtensor.policy import DTensorPolicy

    return DTensorPolicy(config, cluster, name=name, reference=reference)


@hookimpl
def posttrain_policy_backends():
    return {"dtensor": make_policy}


@hookimpl
def posttrain_config_sections():
    return {SECTION: DTensorConfig}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    if config.policy.backend == "dtensor":
        validate_policy_config(config)
