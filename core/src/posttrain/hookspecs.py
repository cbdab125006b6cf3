"""The hooks posttrain calls. Every plugin, built-in or third-party, implements some of these.

A plugin is any module or object registered under the ``posttrain`` entry-point group whose
functions are decorated with :data:`posttrain.hookimpl` and named like a hook below. pluggy
checks argument names against these specifications when the plugin is registered.

Registration hooks (one per seam) each return ``{name: factory}``. The host merges the
answers of all plugins into one registry per kind and refuses a name registered twice,
naming both distributions. What a factory must accept and return is stated per hook.
Every Ray worker and ``posttrain plugins`` load every plugin and call these hooks, so a
plugin module and its registration hooks import nothing heavy (torch, transformers, Ray):
a factory imports its implementation when it is called.

Lifecycle hooks observe or adjust a run; every implementation is called (no first-result).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from posttrain.config import RunConfig

hookspec = pluggy.HookspecMarker("posttrain")

Factory = Callable[..., Any]


# --------------------------------------------------------------------------- registration


@hookspec
def posttrain_policy_backends() -> Mapping[str, Factory]:
    """Register policy (training) backends.

    Each factory is called as ``factory(config: RunConfig, cluster: VirtualCluster)`` and
    returns a :class:`posttrain.interfaces.Policy`. It reads ``config.policy`` and its own
    section (registered with :func:`posttrain_config_sections`). Selected by
    ``policy.backend``.
    """


@hookspec
def posttrain_generation_backends() -> Mapping[str, Factory]:
    """Register generation (rollout) backends.

    Each factory is called as ``factory(config: RunConfig, cluster: VirtualCluster)`` and
    returns a :class:`posttrain.interfaces.Generation`. Selected by ``generation.backend``.
    """


@hookspec
def posttrain_environments() -> Mapping[str, Factory]:
    """Register environments.

    Each factory is called as ``factory(options: Mapping[str, Any])`` with the mapping under
    ``environments.<name>`` and returns a :class:`posttrain.interfaces.Environment`. It is
    called inside a Ray worker process, so the plugin must be importable there (it is: the
    host loads entry points in every worker).
    """


@hookspec
def posttrain_losses() -> Mapping[str, Factory]:
    """Register loss functions.

    Each factory is called as ``factory(options)`` with its algorithm's typed loss options
    and returns a :class:`posttrain.interfaces.LossFunction`.
    """


@hookspec
def posttrain_data_planes() -> Mapping[str, Factory]:
    """Register data planes (how a step's batch moves between driver and workers).

    Each factory is called as ``factory(config: RunConfig)`` and returns a
    :class:`posttrain.interfaces.DataPlane`. Selected by ``data_plane.backend``; core
    registers ``memory``.
    """


@hookspec
def posttrain_algorithms() -> Mapping[str, Factory]:
    """Register algorithms (what ``posttrain run NAME`` runs).

    Each factory is a class or callable returning a :class:`posttrain.interfaces.Algorithm`
    when called with no arguments.
    """


@hookspec
def posttrain_commands() -> Mapping[str, Factory]:
    """Register subcommands of the ``posttrain`` command line (``posttrain NAME ...``).

    Each value is a :class:`posttrain.cli.Command`: its ``help`` line, a function that adds
    its arguments to an ``argparse`` parser, and a function that runs it with the parsed
    arguments and returns the exit status. ``run`` and ``plugins`` are core's own and cannot
    be registered. Errors raised as :class:`posttrain.errors.PosttrainError` print as one
    ``error:`` paragraph and exit with status 2, as for core's commands.
    """


# --------------------------------------------------------------------------- configuration


@hookspec
def posttrain_config_sections() -> Mapping[str, type]:
    """Contribute typed configuration sections.

    Return ``{dotted.path: attrs_class}``: e.g. ``{"grpo": GRPOConfig}`` for a top-level
    section or ``{"policy.dtensor": DTensorConfig}`` for a backend's subsection. The loader
    structures the YAML subtree at that path into the class (every field needs a default
    unless the user must set it) and refuses keys no class declares. Read the result with
    ``config.section("grpo")``. A path may be contributed by one plugin only.
    """


@hookspec
def posttrain_validate_config(config: RunConfig) -> None:
    """Check a fully structured config before any worker starts.

    Raise :class:`posttrain.errors.ConfigError` naming the key, what was expected and what
    was found (with the numbers, for batch-size arithmetic). Called once per run, after
    every section is typed; return nothing when the config is acceptable. Every installed
    plugin is asked: a backend checks its section only when ``config.policy.backend`` (or
    ``generation.backend``) names it, an algorithm only when ``config.algorithm`` does.
    """


# --------------------------------------------------------------------------- run lifecycle


@hookspec
def posttrain_run_start(config: RunConfig, run_dir: str) -> None:
    """Called once when a run starts, after validation and before the first step.

    Metric loggers open their sinks here; ``run_dir`` is where the run writes its outputs.
    """


@hookspec
def posttrain_step_end(step: int, metrics: Mapping[str, float], phase: str) -> None:
    """Called after every training step (``phase == "train"``) and every validation pass
    (``phase == "validation"``) with that step's scalar metrics.

    ``step`` counts from 1. Observers (metric sinks, early stoppers, alerting) implement
    this; they must not mutate ``metrics``.
    """


@hookspec
def posttrain_run_end(config: RunConfig, run_dir: str, status: str) -> None:
    """Called once when a run ends; ``status`` is ``"completed"``, ``"interrupted"`` or
    ``"failed"``. Sinks flush and close here."""
