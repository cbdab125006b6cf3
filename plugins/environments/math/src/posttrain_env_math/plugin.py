"""Hook implementations of posttrain-env-math."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config import RunConfig
from posttrain.environments import CALL_TIMEOUT_KEY
from posttrain_env_math.guess_number import GuessNumberOptions, build_guess_number_environment
from posttrain_env_math.math_env import MathOptions, build_math_environment
from posttrain_env_math.options import read_options

_OPTIONS = {"math": MathOptions, "guess_number": GuessNumberOptions}


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"math": build_math_environment, "guess_number": build_guess_number_environment}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    """Check ``environments.math`` and ``environments.guess_number`` before any worker starts."""
    for name, options_cls in _OPTIONS.items():
        options = {k: v for k, v in config.environments.get(name, {}).items() if k != CALL_TIMEOUT_KEY}
        read_options(options_cls, options, name)
