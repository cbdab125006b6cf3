"""Hook implementations of posttrain-dpo."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config import require_registered
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_dpo.algorithm import DPO
from posttrain_dpo.config import DPOConfig, check_options, check_pair_batching
from posttrain_dpo.loss import DPOLoss


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"dpo": DPO}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"dpo": DPOLoss.from_options}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"dpo": DPOConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    options = config.sections.get("dpo")
    if options is None:
        return
    problems = check_options(options)
    if config.algorithm == "dpo":
        problems += check_pair_batching(config, options)
    if problems:
        raise ConfigError("; ".join(problems))
    if config.algorithm == "dpo":
        require_registered(plugin_host().losses, options.loss, "dpo.loss", config=config)
