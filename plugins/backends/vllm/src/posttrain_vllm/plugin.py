"""Hook implementations of posttrain-vllm: the ``vllm`` generation backend and its config section.

Every Ray worker loads this module, so it imports nothing heavy, and never vLLM, which
changes the settings of the process that imports it: torch and Ray are imported by the
factory when a run builds the backend, vLLM only by the engine actors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain_vllm.config import SECTION, VllmGenerationConfig, validate_generation_config

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.distributed import VirtualCluster
    from posttrain.interfaces import Generation


def make_generation(config: RunConfig, cluster: VirtualCluster) -> Generation:
    """Factory of the ``vllm`` backend: start the engine worker group."""
    from posttrain_vllm.generation import create_vllm_generation

    return create_vllm_generation(config, cluster)


@hookimpl
def posttrain_generation_backends() -> Mapping[str, Any]:
    return {"vllm": make_generation}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {SECTION: VllmGenerationConfig}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    if config.generation.backend == "vllm":
        validate_generation_config(config)
