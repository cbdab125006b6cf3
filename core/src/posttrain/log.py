"""Event logging with structlog: readable lines on the terminal, JSON lines in a file.

Below ``logger.level: debug`` the libraries a run starts (torch, transformers, Ray, the
engines) print only their errors: :func:`library_log_level` and :func:`library_env` say how,
for loggers and for the worker processes' environment (:func:`quiet_libraries` for a
worker's rank in the driver's process). Lines written while a progress bar
is on the terminal go above it (:func:`above_progress_bars`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import structlog

_FILE: TextIO | None = None
_LEVEL = "info"
_CONFIGURED = False  # whether configure_logging ran in this process (the driver)

#: What a process of the run reads at start to print only errors: torch's C++ warnings, the
#: verbosity of transformers, the Hub's and transformers' progress bars ("Loading weights"),
#: and Python's deprecation notices (for library authors, never actionable in a run).
QUIET_LIBRARY_ENV: dict[str, str] = {
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning",
    "POSTTRAIN_QUIET_LIBRARIES": "1",  # read by libraries_quiet()
}


def configure_logging(level: str = "info", events_file: str | Path | None = None) -> None:
    """Route structlog events to stderr (coloured when a terminal) and, when given, as JSON
    to ``events_file``. Safe to call again (the previous file is closed). ``level`` also
    sets what the libraries print (:func:`library_log_level`, :func:`library_env`)."""
    global _FILE, _LEVEL, _CONFIGURED
    numeric = _numeric_level(level)
    if _FILE is not None:
        _FILE.close()
        _FILE = None
    if events_file is not None:
        Path(events_file).parent.mkdir(parents=True, exist_ok=True)
        _FILE = open(events_file, "a", buffering=1)
    _LEVEL, _CONFIGURED = level.lower(), True
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
        logger_factory=lambda *args: TerminalLogger(),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "posttrain") -> Any:
    return structlog.get_logger(name)


def configured_level() -> str:
    """The ``logger.level`` this process was last configured with ("info" before that)."""
    return _LEVEL


def library_log_level(level: str | None = None) -> int:
    """The level the libraries' own loggers get under posttrain's ``level`` (default: the
    configured one): ``logging.ERROR``, or ``logging.INFO`` (everything they print by
    default) at debug."""
    return logging.INFO if _numeric_level(level or _LEVEL) <= logging.DEBUG else logging.ERROR


def library_env(level: str | None = None) -> dict[str, str]:
    """Environment variables for the run's worker processes under posttrain's ``level``
    (default: the configured one): :data:`QUIET_LIBRARY_ENV` below debug, nothing at debug.
    A variable already set in this process's environment is left to it."""
    if library_log_level(level) < logging.ERROR:
        return {}
    return {key: value for key, value in QUIET_LIBRARY_ENV.items() if key not in os.environ}


def libraries_quiet() -> bool:
    """Whether this process's libraries print only their errors: in the driver, below
    ``logger.level: debug``; in a worker process, when it was started with
    :func:`library_env`'s variables (so, below debug too)."""
    if _CONFIGURED:
        return library_log_level() >= logging.ERROR
    return os.environ.get("POSTTRAIN_QUIET_LIBRARIES") == "1"


def quiet_library_warnings(*packages: str) -> None:
    """When :func:`libraries_quiet`, hide from now on the Python warnings that ``packages``
    and their submodules issue in this process (notices a run cannot act on, e.g. that an
    optional acceleration is not installed). Call it before importing them: many warn at
    import."""
    if libraries_quiet():
        for package in packages:
            warnings.filterwarnings("ignore", module=rf"{re.escape(package)}(\.|$)")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the block, what :func:`library_env` gives a worker process, in this one: below
    debug, transformers prints only its errors and no progress bar ("Loading weights").
    The previous settings are put back after."""
    if library_log_level() < logging.ERROR:
        yield
        return
    from transformers.utils import logging as transformers_logging

    verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


@contextlib.contextmanager
def above_progress_bars(stream: TextIO) -> Iterator[None]:
    """While the body writes whole lines to ``stream``, the tqdm bars drawn on the terminal
    are cleared, and drawn again after it: the lines go above the bars, never into them."""
    tqdm_std = sys.modules.get("tqdm.std")
    if tqdm_std is None or not tqdm_std.tqdm._instances:  # no bar is drawn
        yield
        return
    with tqdm_std.tqdm.external_write_mode(file=stream):
        yield


class TerminalLogger:
    """structlog's logger for the terminal: each event as one line on the stderr of the
    moment (a stream replaced since logging was configured, e.g. by a test's capture, may
    be closed by then), above any progress bar."""

    def msg(self, message: str) -> None:
        stream = sys.stderr
        with above_progress_bars(stream):
            stream.write(message + "\n")
            stream.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = failure = err = msg


def _numeric_level(level: str) -> int:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"logger.level: expected one of debug, info, warning, error; found '{level}'")
    return numeric
