"""Hook implementations of posttrain-grpo."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config.schema import RunConfig
from posttrain.plugins import plugin_host
from posttrain_grpo.config import GRPOConfig
from posttrain_grpo.loss import ClippedPGLoss
from posttrain_grpo.validation import validate_run_config


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"grpo": GRPOConfig}


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    from posttrain_grpo.algorithm import GRPO

    return {"grpo": GRPO}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"clipped_pg": ClippedPGLoss}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    validate_run_config(config, plugin_host())
