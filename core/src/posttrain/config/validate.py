"""Checks on a structured config that span several keys or need the plugin registries.

:func:`validate_config` runs core's checks, then every plugin's
``posttrain_validate_config`` hook. Messages name the keys, the numbers and where each key
was set.
"""

from __future__ import annotations

import math
from typing import Any

from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError, PluginError
from posttrain.plugins import PluginHost, Registry, plugin_host


def where_set(config: RunConfig | None, *keys: str) -> str:
    """``" Where set: a.b at exp.yaml:3; c at command line override 'c=1'."`` for the keys the
    loader saw, or ``""``. Plugins append it to their own validation messages."""
    if config is None:
        return ""
    found = [f"{key} at {config.sources[key]}" for key in keys if key in config.sources]
    return f" Where set: {'; '.join(found)}." if found else ""


def require_registered(registry: Registry, name: str, key: str, *, config: RunConfig | None = None) -> Any:
    """``registry[name]``, or a :class:`ConfigError` prefixed by the config ``key`` that chose it:
    ``data_plane.backend: unknown data plane 'tq'; installed: ...``."""
    try:
        return registry[name]
    except PluginError as exc:
        raise ConfigError(f"{key}: {exc}{where_set(config, key)}") from None


def validate_config(config: RunConfig, host: PluginHost | None = None) -> None:
    """Check parallelism and batch arithmetic, the data plane name, then the plugins' checks.

    Raises :class:`ConfigError` on the first problem; returns nothing when the config is fine.
    """
    host = host if host is not None else plugin_host()
    policy = config.policy
    factors = config.replica_factors()
    sizes = [(f"policy.{name}", getattr(policy, name)) for name in
             ("num_workers", "train_global_batch_size", "train_micro_batch_size")]
    for key, value in [*sizes, *factors]:
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, found {value}.{where_set(config, key)}")
    _require_multiple(config, "policy.num_workers", policy.num_workers, factors)
    _require_multiple(
        config,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        [
            ("policy.train_micro_batch_size", policy.train_micro_batch_size),
            ("data-parallel size", config.data_parallel_size),
        ],
    )
    require_registered(host.data_planes, config.data_plane.backend, "data_plane.backend", config=config)
    host.hook.posttrain_validate_config(config=config)


def _require_multiple(config: RunConfig, key: str, value: int, factors: list[tuple[str, int]]) -> None:
    """Raise unless ``value`` is a multiple of the product of ``factors`` ((label, number) pairs)."""
    unit = math.prod(number for _, number in factors)
    if value % unit == 0:
        return
    product = " x ".join(f"{label} ({number})" for label, number in factors)
    suggestion = max(unit, math.ceil(value / unit) * unit)
    raise ConfigError(
        f"{key}={value} is not divisible by {product} = {unit}. Use a multiple of {unit}, e.g. {suggestion}."
        f"{where_set(config, key, *(label for label, _ in factors))}"
    )
