"""Hook implementations: registers the ``reverse`` environment.

Kept free of heavy imports (torch is imported when the environment is built), so listing
plugins stays fast. The factory declares its options class: posttrain reads
``environments.reverse`` into it, and refuses an unknown or mistyped option, when the
config is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config.environments import environment_options
from posttrain_env_reverse.options import ReverseOptions


@environment_options(ReverseOptions)
def build_reverse_environment(options: ReverseOptions) -> Any:
    """The factory posttrain calls with the options under ``environments.reverse``."""
    from posttrain_env_reverse.environment import ReverseEnvironment

    return ReverseEnvironment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"reverse": build_reverse_environment}
