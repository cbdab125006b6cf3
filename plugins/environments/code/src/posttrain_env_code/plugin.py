"""Hook implementations of posttrain-env-code.

Every Ray worker loads this module, so it imports nothing heavy: the environment (torch,
the sandbox) is imported by its factory. The factory declares its options class, which
core reads and checks when the config is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config.environments import environment_options
from posttrain_env_code.options import CodeOptions

if TYPE_CHECKING:
    from posttrain_env_code.environment import CodeEnvironment


@environment_options(CodeOptions)
def code_environment(options: CodeOptions) -> CodeEnvironment:
    """Factory of the ``code`` environment."""
    from posttrain_env_code.environment import CodeEnvironment

    return CodeEnvironment(options)


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"code": code_environment}
