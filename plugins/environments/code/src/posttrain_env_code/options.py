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
    """``timeout_s``: wall-clock limit of one sandbox run; ``memory_mb``: address space per
    process; ``max_output_bytes``: stdout+stderr of one run; ``max_processes``: processes and
    threads of one run; ``disk_mb``: the run's work folder; ``max_concurrency``: runs at once;
    ``namespaces``: Linux namespaces (``auto``, ``require``, ``off``); ``reward``:
    ``fraction`` of tests passed, or ``all`` (1 only when every test passes)."""

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
