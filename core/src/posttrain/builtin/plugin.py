"""Core's own plugin, registered through the same ``posttrain`` entry point as any
third-party plugin. Imports stay lazy so ``posttrain plugins`` runs without torch."""

from __future__ import annotations

from typing import Any

from posttrain import hookimpl


def _memory_data_plane(config: Any) -> Any:
    from posttrain.builtin.memory_plane import MemoryDataPlane

    return MemoryDataPlane()


@hookimpl
def posttrain_data_planes() -> dict[str, Any]:
    return {"memory": _memory_data_plane}
