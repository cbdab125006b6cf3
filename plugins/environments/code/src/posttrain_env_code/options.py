"""Options of the ``code`` environment (the mapping under ``environments.code``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from posttrain.errors import ConfigError, did_you_mean


class _BadOption(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _at_least(minimum: float, *, integer: bool) -> Any:
    """attrs validator: a number (an int when ``integer``; never a bool) >= ``minimum``."""
    kind = "an integer" if integer else "a number"

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        types_ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
        if not types_ok or value < minimum:
            raise _BadOption(attribute.name, f"expected {kind} >= {minimum:g}, found {value!r}")

    return check


def _one_of(*choices: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            hint = did_you_mean(value, list(choices)) if isinstance(value, str) else ""
            raise _BadOption(attribute.name, f"expected one of {', '.join(map(repr, choices))}, found {value!r}.{hint}")

    return check


@attrs.frozen
class CodeOptions:
    """Options of the ``code`` environment (``environments.code``). A sample's ``tests`` run
    together as one sandbox run, each of its ``cases`` as a run of its own.

    - ``timeout_s``: wall-clock seconds of one run (at least 0.1); a run past it is killed and
      counts as a timeout.
    - ``memory_mb``: address space of each process of a run (``RLIMIT_AS``), MiB; at least 64.
    - ``max_output_bytes``: stdout and stderr of one run together; a run writing more is stopped.
    - ``max_processes``: processes and threads of one run (``RLIMIT_NPROC``); at least 4.
    - ``disk_mb``: size of a run's work folder (and of its largest file), MiB.
    - ``max_concurrency``: runs at once (threads of the environment's actor).
    - ``namespaces``: Linux namespaces that cut a run off the network and the filesystem:
      ``auto`` uses them when they work on this machine (and warns when not), ``require``
      fails without them, ``off`` never uses them.
    - ``reward``: ``fraction`` of the tests and cases passed, or ``all`` (1 only when every
      one passes).
    """

    timeout_s: float = attrs.field(default=10.0, validator=_at_least(0.1, integer=False))
    memory_mb: int = attrs.field(default=512, validator=_at_least(64, integer=True))
    max_output_bytes: int = attrs.field(default=1 << 20, validator=_at_least(1, integer=True))
    max_processes: int = attrs.field(default=16, validator=_at_least(4, integer=True))
    disk_mb: int = attrs.field(default=16, validator=_at_least(1, integer=True))
    max_concurrency: int = attrs.field(default=2, validator=_at_least(1, integer=True))
    namespaces: Literal["auto", "require", "off"] = attrs.field(
        default="auto", validator=_one_of("auto", "require", "off")
    )
    reward: Literal["fraction", "all"] = attrs.field(default="fraction", validator=_one_of("fraction", "all"))


def read_options(options: Mapping[str, Any]) -> CodeOptions:
    """``CodeOptions(**options)``, refusing unknown keys and bad values with the config key."""
    known = [field.name for field in attrs.fields(CodeOptions)]
    for key in options:
        if key not in known:
            hint = did_you_mean(key, known, prefix="environments.code.") or f" Valid keys here: {', '.join(known)}."
            raise ConfigError(f"unknown config key 'environments.code.{key}'.{hint}")
    try:
        return CodeOptions(**options)
    except _BadOption as exc:
        raise ConfigError(f"config key 'environments.code.{exc.key}': {exc}") from exc
