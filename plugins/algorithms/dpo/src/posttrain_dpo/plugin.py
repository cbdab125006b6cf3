"""Hook implementations of posttrain-dpo."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.errors import ConfigError

from posttrain_dpo.config import DPOConfig, check_options
from posttrain_dpo.loss import DPOLoss


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"dpo": DPOLoss.from_options}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"dpo": DPOConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    options = config.sections.get("dpo")
    if options is not None:
        problems = check_options(options)
        if problems:
            raise ConfigError("; ".join(problems))
