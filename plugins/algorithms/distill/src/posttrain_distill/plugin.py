"""Hook implementations of posttrain-distill: the ``distill`` algorithm and its config section.

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
from posttrain_distill.config import DistillConfig, check_distill_config

if TYPE_CHECKING:
    from posttrain_distill.algorithm import Distill


def distill_algorithm() -> Distill:
    """Factory of the ``distill`` algorithm."""
    from posttrain_distill.algorithm import Distill

    return Distill()


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"distill": distill_algorithm}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"distill": DistillConfig}


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    if config.algorithm != "distill":
        return
    problems = check_distill_config(config.section("distill"), config)
    if problems:
        raise ConfigError(" ".join(problems))
    host = plugin_host()
    require_registered(host.generation_backends, config.generation.backend, "generation.backend", config=config)
    require_registered(host.policy_backends, config.policy.backend, "policy.backend", config=config)
    teacher = config.section("distill").teacher
    require_registered(host.policy_backends, teacher.backend, "distill.teacher.backend", config=config)
