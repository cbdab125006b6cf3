"""posttrain: a plugin-based library for post-training language models."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: Decorate plugin functions with this to implement a hook from :mod:`posttrain.hookspecs`.
hookimpl = pluggy.HookimplMarker("posttrain")

__all__ = ["__version__", "hookimpl"]
