"""Hook implementations of posttrain-sft."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config import require_registered
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_sft.algorithm import SFT
from posttrain_sft.config import SFTConfig, check_loop_options
from posttrain_sft.loss import NLLLoss


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"sft": SFT}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"nll": NLLLoss.from_options}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"sft": SFTConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    options = config.sections.get("sft")
    if options is None:
        return
    problems = check_loop_options("sft", options)
    if problems:
        raise ConfigError("; ".join(problems))
    if config.algorithm == "sft":
        require_registered(plugin_host().losses, options.loss, "sft.loss", config=config)
