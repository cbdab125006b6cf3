"""Hook implementations of posttrain-dpo.

Every Ray worker loads this module, so it imports nothing heavy: the algorithm and the loss
(torch) are imported by their factories when a run builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config import require_registered
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_dpo.config import DPOConfig, check_options, check_pair_batching

if TYPE_CHECKING:
    from posttrain_dpo.algorithm import DPO
    from posttrain_dpo.loss import DPOLoss


def dpo_algorithm() -> DPO:
    """Factory of the ``dpo`` algorithm."""
    from posttrain_dpo.algorithm import DPO

    return DPO()


def dpo_loss(options: DPOConfig) -> DPOLoss:
    """Factory of the ``dpo`` loss (``options``: the ``dpo`` section)."""
    from posttrain_dpo.loss import DPOLoss

    return DPOLoss.from_options(options)


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"dpo": dpo_algorithm}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"dpo": dpo_loss}


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
