"""Hook implementations of posttrain-hf: the ``hf`` generation backend and its config section.

Every Ray worker loads this module, so it imports nothing heavy: torch, transformers and
Ray are imported by the factory when a run builds the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain_hf.config import SECTION, HFGenerationConfig, validate_generation_config

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.distributed import VirtualCluster
    from posttrain.interfaces import Generation, Policy


def make_generation(config: RunConfig, cluster: VirtualCluster, *, host: Policy | None = None) -> Generation:
    """Factory of the ``hf`` backend: start the engine worker group, or the engines inside
    the ``host`` policy's workers (``generation.in_policy_workers``)."""
    from posttrain_hf.generation import create_hf_generation

    return create_hf_generation(config, cluster, host=host)


@hookimpl
def posttrain_generation_backends() -> Mapping[str, Any]:
    return {"hf": make_generation}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {SECTION: HFGenerationConfig}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    if config.generation.backend == "hf":
        validate_generation_config(config)
