"""Hook implementations of posttrain-megatron: the ``megatron`` policy backend and its
``policy.megatron`` configuration section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain import hookimpl
from posttrain.log import quiet_library_warnings
from posttrain_megatron.config import SECTION, MegatronConfig, validate_policy_config

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.distributed import VirtualCluster
    from posttrain.interfaces import Policy


def make_policy(config: RunConfig, cluster: VirtualCluster, *, name: str = "policy", reference: bool = True) -> Policy:
    """Factory of the ``megatron`` backend: start the worker group ``name`` and load the model."""
    quiet_library_warnings("megatron")  # in the driver too (see the package's module)
    from posttrain_megatron.policy import MegatronPolicy

    return MegatronPolicy(config, cluster, name=name, reference=reference)


@hookimpl
def posttrain_policy_backends():
    return {"megatron": make_policy}


@hookimpl
def posttrain_config_sections():
    return {SECTION: MegatronConfig}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    if config.policy.backend == "megatron":
        validate_policy_config(config)
