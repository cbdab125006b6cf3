"""Hook implementations of posttrain-env-math.

Every Ray worker loads this module, so it imports nothing heavy: the environments (torch,
math-verify) are imported by their factories when an environment is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain_env_math.options import GuessNumberOptions, MathOptions, read_options

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain_env_math.guess_number import GuessNumberEnvironment
    from posttrain_env_math.math_env import MathEnvironment

_OPTIONS = {"math": MathOptions, "guess_number": GuessNumberOptions}


def math_environment(options: Mapping[str, Any]) -> MathEnvironment:
    """Factory of the ``math`` environment."""
    from posttrain_env_math.math_env import build_math_environment

    return build_math_environment(options)


def guess_number_environment(options: Mapping[str, Any]) -> GuessNumberEnvironment:
    """Factory of the ``guess_number`` environment."""
    from posttrain_env_math.guess_number import build_guess_number_environment

    return build_guess_number_environment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"math": math_environment, "guess_number": guess_number_environment}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    """Check ``environments.math`` and ``environments.guess_number`` before any worker starts."""
    from posttrain.run.environments import CALL_TIMEOUT_KEY  # imports torch: only when validating a run

    for name, options_cls in _OPTIONS.items():
        options = {k: v for k, v in config.environments.get(name, {}).items() if k != CALL_TIMEOUT_KEY}
        read_options(options_cls, options, name)
