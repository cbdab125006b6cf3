"""Hook implementations of posttrain-env-tools.

Every Ray worker loads this module, so it imports nothing heavy: the environment (torch,
the tools, the worker pool) is imported by its factory, which declares its options class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config.environments import environment_options
from posttrain_env_tools.options import ToolsOptions

if TYPE_CHECKING:
    from posttrain_env_tools.environment import ToolsEnvironment


@environment_options(ToolsOptions)
def tools_environment(options: ToolsOptions) -> ToolsEnvironment:
    """Factory of the ``tools`` environment."""
    from posttrain_env_tools.environment import ToolsEnvironment

    return ToolsEnvironment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"tools": tools_environment}
