"""Running one tool call: imported and called by the environment's deadline pool workers."""

from __future__ import annotations

from typing import Any

from posttrain_env_tools.tool import load_function


def invoke(target: str, arguments: dict[str, Any]) -> str:
    """Call the function ``target`` (``"package.module:function"``) with ``arguments``; its
    result as text. Raises what the function raises."""
    return str(load_function(target)(**arguments))
