"""Hook implementations of posttrain-env-math.

Every Ray worker loads this module, so it imports nothing heavy: the environments (torch,
math-verify) are imported by their factories when an environment is built. Each factory
declares its options class, which core reads and checks when the config is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config.environments import environment_options
from posttrain_env_math.options import GuessNumberOptions, MathOptions

if TYPE_CHECKING:
    from posttrain_env_math.guess_number import GuessNumberEnvironment
    from posttrain_env_math.math_env import MathEnvironment


@environment_options(MathOptions)
def math_environment(options: MathOptions) -> MathEnvironment:
    """Factory of the ``math`` environment."""
    from posttrain_env_math.math_env import MathEnvironment

    return MathEnvironment(options)


@environment_options(GuessNumberOptions)
def guess_number_environment(options: GuessNumberOptions) -> GuessNumberEnvironment:
    """Factory of the ``guess_number`` environment."""
    from posttrain_env_math.guess_number import GuessNumberEnvironment

    return GuessNumberEnvironment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"math": math_environment, "guess_number": guess_number_environment}
