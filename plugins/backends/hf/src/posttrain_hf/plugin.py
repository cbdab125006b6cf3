"""Hook implementations of posttrain-hf: the ``hf`` generation backend and its config section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain_hf.config import SECTION, HFGenerationConfig


@hookimpl
def posttrain_generation_backends() -> Mapping[str, Any]:
    from posttrain_hf.generation import create_hf_generation

    return {"hf": create_hf_generation}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {SECTION: HFGenerationConfig}
