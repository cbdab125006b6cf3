"""The environments' options (the mapping under ``environments.<name>``) as attrs classes,
and how they are read. Torch-free: the plugin's config validation imports only this."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from posttrain.errors import ConfigError, did_you_mean

T = TypeVar("T")


def read_options(cls: type[T], options: Mapping[str, Any], env_name: str) -> T:
    """``cls(**options)``, refusing unknown keys and invalid values with the config key path.

    Type and range checks are the class's attrs validators.
    """
    prefix = f"environments.{env_name}."
    known = [field.name for field in attrs.fields(cls)]  # type: ignore[arg-type]
    for key in options:
        if key not in known:
            hint = did_you_mean(key, known, prefix=prefix) or f" Valid keys here: {', '.join(known)}."
            raise ConfigError(f"unknown config key '{prefix}{key}'.{hint}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key '{prefix[:-1]}': {exc}") from exc


def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: a number (not a bool) greater than 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"'{attribute.name}' must be a number greater than 0, found {value!r}")


def positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: an int (not a bool) greater than 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"'{attribute.name}' must be an integer greater than 0, found {value!r}")


@attrs.frozen
class MathOptions:
    """Options of the ``math`` environment (``environments.math``)."""

    # seconds to extract and verify one response (> 0); a slower one scores 0 and counts in verify_timeouts
    timeout_s: float = attrs.field(default=10.0, validator=positive)
    num_workers: int = attrs.field(default=2, validator=positive_int)  # verifier processes scoring responses in parallel


@attrs.frozen
class GuessNumberOptions:
    """Options of the ``guess_number`` environment (``environments.guess_number``)."""

    # guesses a game allows; the last one wrong ends it with reward 0 (grpo.max_rollout_turns: at least this)
    max_guesses: int = attrs.field(default=8, validator=positive_int)
