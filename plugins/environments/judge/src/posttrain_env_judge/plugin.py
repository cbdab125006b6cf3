"""Hook implementation of posttrain-env-judge.

Every Ray worker loads this module, so it imports nothing heavy: the judge (torch,
transformers) is imported by the factory when the environment is built, in its own actor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config.environments import environment_options
from posttrain_env_judge.options import JudgeOptions

if TYPE_CHECKING:
    from posttrain_env_judge.environment import JudgeEnvironment


@environment_options(JudgeOptions)
def judge_environment(options: JudgeOptions) -> JudgeEnvironment:
    """Factory of the ``judge`` environment."""
    from posttrain_env_judge.environment import JudgeEnvironment

    return JudgeEnvironment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"judge": judge_environment}
