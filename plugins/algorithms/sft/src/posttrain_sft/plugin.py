"""Hook implementations of posttrain-sft.

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
from posttrain.run.supervised_config import check_supervised_config
from posttrain_sft.config import SFTConfig

if TYPE_CHECKING:
    from posttrain_sft.algorithm import SFT
    from posttrain_sft.loss import NLLLoss


def sft_algorithm() -> SFT:
    """Factory of the ``sft`` algorithm."""
    from posttrain_sft.algorithm import SFT

    return SFT()


def nll_loss(options: Any = None) -> NLLLoss:
    """Factory of the ``nll`` loss (``options``: the ``sft`` section; NLL has none)."""
    from posttrain_sft.loss import NLLLoss

    return NLLLoss.from_options(options)


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"sft": sft_algorithm}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"nll": nll_loss}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"sft": SFTConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    options = config.sections.get("sft")
    if options is None:
        return
    problems = check_supervised_config("sft", options)
    if problems:
        raise ConfigError("; ".join(problems))
    if config.algorithm == "sft":
        require_registered(plugin_host().losses, options.loss, "sft.loss", config=config)
