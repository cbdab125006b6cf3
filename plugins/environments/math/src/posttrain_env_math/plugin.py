"""Hook implementations of posttrain-env-math.

Every Ray worker loads this module, so it imports nothing heavy: the environments (torch,
math-verify) are imported by their factories when an environment is built. Each factory
declares its options class, which core reads and checks when the config is loaded, and the
metadata keys its samples need, which core checks in every data row before the run starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config.environments import environment_options, requires_metadata, runs_in_driver
from posttrain_env_math.options import GuessNumberOptions, MathOptions

if TYPE_CHECKING:
    from posttrain_env_math.guess_number import GuessNumberEnvironment
    from posttrain_env_math.math_env import MathEnvironment


@runs_in_driver  # scores in its deadline pool's processes
@requires_metadata(answer="the ground truth the final answer is compared with")
@environment_options(MathOptions)
def math_environment(options: MathOptions) -> MathEnvironment:
    """Factory of the ``math`` environment."""
    from posttrain_env_math.math_env import MathEnvironment

    return MathEnvironment(options)


@runs_in_driver  # compares two integers
@requires_metadata(target="the integer the model must guess")
@environment_options(GuessNumberOptions)
def guess_number_environment(options: GuessNumberOptions) -> GuessNumberEnvironment:
    """Factory of the ``guess_number`` environment."""
    from posttrain_env_math.guess_number import GuessNumberEnvironment

    return GuessNumberEnvironment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"math": math_environment, "guess_number": guess_number_environment}
