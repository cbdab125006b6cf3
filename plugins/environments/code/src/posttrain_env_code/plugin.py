"""Hook implementations of posttrain-env-code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttrain import hookimpl
from posttrain.config import RunConfig
from posttrain.run.environments import CALL_TIMEOUT_KEY
from posttrain_env_code.environment import build_code_environment
from posttrain_env_code.options import read_options


@hookimpl
def posttrain_environments() -> Mapping[str, Callable[..., Any]]:
    return {"code": build_code_environment}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    """Check ``environments.code`` before any worker starts."""
    read_options({k: v for k, v in config.environments.get("code", {}).items() if k != CALL_TIMEOUT_KEY})
