"""Core's own plugin, registered through the same entry point as any third-party plugin."""

from __future__ import annotations

from posttrain import hookimpl
