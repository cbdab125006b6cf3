"""Hook implementations of posttrain-vllm: the ``vllm`` generation backend and its config section.

Nothing here imports vLLM: plugins are loaded in every Ray worker, and vLLM changes the
settings of the process that imports it, so only the engine actors do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain_vllm.config import SECTION, VllmGenerationConfig


@hookimpl
def posttrain_generation_backends() -> Mapping[str, Any]:
    from posttrain_vllm.generation import create_vllm_generation

    return {"vllm": create_vllm_generation}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {SECTION: VllmGenerationConfig}
