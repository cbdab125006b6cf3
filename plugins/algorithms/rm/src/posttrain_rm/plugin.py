"""Hook implementations of posttrain-rm: the ``rm`` algorithm, its ``bradley_terry`` loss and
config section, and the ``reward_model`` environment.

Every Ray worker loads this module, so it imports nothing heavy: the algorithm, the loss and
the environment (torch, transformers) are imported by their factories.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config import require_registered
from posttrain.config.environments import environment_options
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_rm.config import RewardModelOptions, RMConfig, check_options

if TYPE_CHECKING:
    from posttrain_rm.algorithm import RewardModel
    from posttrain_rm.environment import RewardModelEnvironment
    from posttrain_rm.loss import BradleyTerryLoss


def rm_algorithm() -> RewardModel:
    """Factory of the ``rm`` algorithm."""
    from posttrain_rm.algorithm import RewardModel

    return RewardModel()


def bradley_terry_loss(options: RMConfig) -> BradleyTerryLoss:
    """Factory of the ``bradley_terry`` loss (``options``: the ``rm`` section)."""
    from posttrain_rm.loss import BradleyTerryLoss

    return BradleyTerryLoss.from_options(options)


@environment_options(RewardModelOptions)
def reward_model_environment(options: RewardModelOptions) -> RewardModelEnvironment:
    """Factory of the ``reward_model`` environment."""
    from posttrain_rm.environment import RewardModelEnvironment

    return RewardModelEnvironment(options)


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"rm": rm_algorithm}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"bradley_terry": bradley_terry_loss}


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {"reward_model": reward_model_environment}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"rm": RMConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    options = config.sections.get("rm")
    if options is None:
        return
    problems = check_options(options)
    if problems:
        raise ConfigError("; ".join(problems))
    if config.algorithm == "rm":
        require_registered(plugin_host().losses, options.loss, "rm.loss", config=config)
