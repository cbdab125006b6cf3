"""Hook implementations of posttrain-ppo: the ``ppo`` algorithm and its config section.

Every Ray worker loads this module, so it imports nothing heavy: the algorithm (torch) is
imported by its factory when a run builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config import require_registered
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_grpo.config import GRPOConfig
from posttrain_grpo.validation import check_grpo_config, check_loss_config
from posttrain_ppo.config import PPOConfig, check_ppo_config

if TYPE_CHECKING:
    from posttrain_ppo.algorithm import PPO


def ppo_algorithm() -> PPO:
    """Factory of the ``ppo`` algorithm."""
    from posttrain_ppo.algorithm import PPO

    return PPO()


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"ppo": ppo_algorithm}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"ppo": PPOConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    """A ``ppo`` run: the ``grpo`` section as GRPO checks it (PPO runs GRPO's loop with it),
    then the ``ppo`` section."""
    if config.algorithm != "ppo":
        return
    grpo: GRPOConfig = config.sections.get("grpo") or GRPOConfig()
    check_loss_config(grpo.loss, "grpo.loss", config)
    check_grpo_config(grpo, config)
    problems = check_ppo_config(config.section("ppo"), config)
    if problems:
        raise ConfigError(" ".join(problems))
    host = plugin_host()
    require_registered(host.policy_backends, config.policy.backend, "policy.backend", config=config)
    require_registered(host.generation_backends, config.generation.backend, "generation.backend", config=config)
    critic = config.section("ppo").critic
    require_registered(host.policy_backends, critic.backend, "ppo.critic.backend", config=config)
