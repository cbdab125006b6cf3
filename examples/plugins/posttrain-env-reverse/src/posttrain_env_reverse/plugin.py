"""Hook implementations: registers the ``reverse`` environment.

Kept free of heavy imports (torch is imported when the environment is built), so listing
plugins stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttrain import hookimpl


def build_reverse_environment(options: Mapping[str, Any]) -> Any:
    """The factory posttrain calls with the mapping under ``environments.reverse``."""
    from posttrain_env_reverse.environment import ReverseEnvironment

    return ReverseEnvironment.from_options(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"reverse": build_reverse_environment}
