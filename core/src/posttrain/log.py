"""Event logging with structlog: readable lines on the terminal, JSON lines in a file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

_FILE: TextIO | None = None


def configure_logging(level: str = "info", events_file: str | Path | None = None) -> None:
    """Route structlog events to stderr (coloured when a terminal) and, when given, as JSON
    to ``events_file``. Safe to call again (the previous file is closed)."""
    global _FILE
    if _FILE is not None:
        _FILE.close()
        _FILE = None
    if events_file is not None:
        Path(events_file).parent.mkdir(parents=True, exist_ok=True)
        _FILE = open(events_file, "a", buffering=1)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"logger.level: expected one of debug, info, warning, error; found '{level}'")
    console = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    as_json = structlog.processors.JSONRenderer()

    def tee(logger: Any, method: str, event: dict[str, Any]) -> str:
        if _FILE is not None:
            _FILE.write(as_json(logger, method, dict(event)) + "\n")
        return console(logger, method, event)

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            tee,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # sys.stderr as it is when an event is written, not when logging was configured
        # (a stream replaced since, e.g. by a test's capture, may be closed by then).
        logger_factory=lambda *args: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "posttrain") -> Any:
    return structlog.get_logger(name)
