"""The hooks posttrain calls. Every plugin, built-in or third-party, implements some of these.

A plugin is any module or object registered under the ``posttrain`` entry-point group whose
functions are decorated with :data:`posttrain.hookimpl` and named like a hook below. pluggy
checks argument names against these specifications when the plugin is registered.

Registration hooks (one per seam) each return ``{name: factory}``. The host merges the
answers of all plugins into one registry per kind and refuses a name registered twice,
naming both distributions. What a factory is called with and returns is its registry's
protocol below (:class:`PolicyBackendFactory`, ...). Every Ray worker and ``posttrain
plugins`` load every plugin and call these hooks, so a plugin module and its registration
hooks import nothing heavy (torch, transformers, Ray): a factory imports its implementation
when it is called.

Lifecycle hooks observe or adjust a run; every implementation is called (no first-result).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.interfaces import Algorithm, Command, DataPlane, Environment, Generation, LossFunction, Policy
    from posttrain.interfaces.metric_sink import MetricSink

hookspec = pluggy.HookspecMarker("posttrain")


# --------------------------------------------------------------------------- factories


class PolicyBackendFactory(Protocol):
    """``factory(config, cluster, name=..., reference=...)``: start a policy backend's workers on
    ``cluster`` (the run's :class:`posttrain.distributed.VirtualCluster`) for the model ``config.policy`` describes, as the worker group ``name`` (its
    placement group; ``"policy"`` for the run's policy, another name for a second model of the
    run, e.g. a critic or a teacher), and return its :class:`~posttrain.interfaces.Policy`.
    ``reference`` False: the run never asks for reference logprobs, so the backend need not
    keep the initial weights for them (asking then raises)."""

    def __call__(
        self, config: RunConfig, cluster: Any, /, *, name: str = "policy", reference: bool = True
    ) -> Policy: ...


class GenerationBackendFactory(Protocol):
    """``factory(config, cluster)``: start a generation backend's engines on ``cluster`` and
    return its :class:`~posttrain.interfaces.Generation`. A backend whose config section
    declares ``runs_in_policy_workers`` is called as ``factory(config, cluster, host=policy)``
    when ``generation.in_policy_workers`` is set: it builds its engines inside the policy's
    workers (:meth:`~posttrain.interfaces.Policy.host_engines`)."""

    def __call__(self, config: RunConfig, cluster: Any, /, *, host: Policy | None = None) -> Generation: ...


class EnvironmentFactory(Protocol):
    """``factory(options)``: the :class:`~posttrain.interfaces.Environment` built from the
    mapping under ``environments.<name>`` (inside the environment's own Ray actor)."""

    def __call__(self, options: Mapping[str, Any], /) -> Environment: ...


class LossFactory(Protocol):
    """``factory(options)``: the :class:`~posttrain.interfaces.LossFunction` built from its
    algorithm's typed loss options (e.g. ``grpo.loss``, the ``sft`` section)."""

    def __call__(self, options: Any, /) -> LossFunction: ...


class DataPlaneFactory(Protocol):
    """``factory(config)``: the run's :class:`~posttrain.interfaces.DataPlane`."""

    def __call__(self, config: RunConfig, /) -> DataPlane: ...


class AlgorithmFactory(Protocol):
    """``factory()``: an :class:`~posttrain.interfaces.Algorithm` (its class, usually)."""

    def __call__(self) -> Algorithm: ...


class MetricSinkFactory(Protocol):
    """``factory(config, run_dir)``: the :class:`~posttrain.interfaces.MetricSink` opened for
    the run ``config`` writing under ``run_dir``, or None when the config leaves it off."""

    def __call__(self, config: RunConfig, run_dir: Path, /) -> MetricSink | None: ...


# --------------------------------------------------------------------------- registration


@hookspec
def posttrain_policy_backends() -> Mapping[str, PolicyBackendFactory]:
    """Register policy (training) backends.

    Each factory is a :class:`PolicyBackendFactory`: called as ``factory(config: RunConfig,
    cluster, name=...)``, it returns a :class:`posttrain.interfaces.Policy`
    whose worker group is named ``name``. It reads ``config.policy`` (including
    ``policy.head``) and its own section (registered with :func:`posttrain_config_sections`).
    Selected by ``policy.backend``; an algorithm's second model (a critic, a teacher) is built
    the same way with its own ``policy`` section and name (:meth:`posttrain.interfaces.RunContext.build_policy`).
    """


@hookspec
def posttrain_generation_backends() -> Mapping[str, GenerationBackendFactory]:
    """Register generation (rollout) backends.

    Each factory is a :class:`GenerationBackendFactory`: called as ``factory(config:
    RunConfig, cluster)``, it returns a
    :class:`posttrain.interfaces.Generation`. Selected by ``generation.backend``.
    """


@hookspec
def posttrain_environments() -> Mapping[str, EnvironmentFactory]:
    """Register environments.

    Each factory is an :class:`EnvironmentFactory`: called as ``factory(options:
    Mapping[str, Any])`` with the mapping under ``environments.<name>``, it returns a
    :class:`posttrain.interfaces.Environment`. It is called inside a Ray worker process, so
    the plugin must be importable there (it is: the host loads entry points in every
    worker). Algorithms start environments with
    :meth:`posttrain.run.context.RunContext.build_environments`.

    Declare a factory's options once with
    :func:`posttrain.config.environments.environment_options` (an attrs class): core then
    checks ``environments.<name>`` when the config is loaded, like a config section (types,
    choices, unknown keys with a suggestion, file and line), and the factory receives the
    instance. Core's own options (``call_timeout_s``, ``call_retries``,
    ``max_failed_fraction``) are accepted under every environment and never passed on. An
    undeclared factory receives the raw mapping, unchecked.
    """


@hookspec
def posttrain_losses() -> Mapping[str, LossFactory]:
    """Register loss functions.

    Each factory is a :class:`LossFactory`: called as ``factory(options)`` with its
    algorithm's typed loss options, it returns a :class:`posttrain.interfaces.LossFunction`.
    """


@hookspec
def posttrain_data_planes() -> Mapping[str, DataPlaneFactory]:
    """Register data planes (how a step's batch moves between driver and workers).

    Each factory is a :class:`DataPlaneFactory`: called as ``factory(config: RunConfig)``,
    it returns a :class:`posttrain.interfaces.DataPlane`. Selected by
    ``data_plane.backend``; core registers ``memory``.
    """


@hookspec
def posttrain_algorithms() -> Mapping[str, AlgorithmFactory]:
    """Register algorithms (what ``posttrain run NAME`` runs).

    Each factory is an :class:`AlgorithmFactory`: a class or callable returning a
    :class:`posttrain.interfaces.Algorithm` when called with no arguments.
    """


@hookspec
def posttrain_commands() -> Mapping[str, Command]:
    """Register subcommands of the ``posttrain`` command line (``posttrain NAME ...``).

    Each value is a :class:`posttrain.interfaces.Command`: its ``help`` line, a function that adds
    its arguments to an ``argparse`` parser, and a function that runs it with the parsed
    arguments and returns the exit status. ``run`` and ``plugins`` are core's own and cannot
    be registered. Errors raised as :class:`posttrain.errors.PosttrainError` print as one
    ``error:`` paragraph and exit with status 2, as for core's commands.
    """


@hookspec
def posttrain_metric_sinks() -> Mapping[str, MetricSinkFactory]:
    """Register metric sinks: where every step's scalar metrics are written.

    Each factory is a :class:`MetricSinkFactory`: called once per run, as the run's context
    is created and before any worker starts, as ``factory(config: RunConfig, run_dir:
    Path)``; it returns a :class:`posttrain.interfaces.MetricSink` opened for that run, or
    None when the config leaves the sink off (core's ``jsonl``, ``tensorboard``, ``wandb``
    and ``mlflow`` read their ``logger.*`` keys; a third-party sink reads its own section,
    or is on whenever installed). The run writes every training step's and validation
    pass's metrics to every open sink, then tells the ``posttrain_step_end`` observers, and
    closes each sink when it ends, however it ends. A factory that raises (a missing
    library: :class:`~posttrain.errors.ConfigError` naming the key) stops the run before it
    starts, after closing the sinks already open.

    Why a registry and not the lifecycle hooks alone: a sink is per-run state (an open file,
    a tracking-server run), which a factory returns as an object the run owns, where a
    plugin made of hook functions would keep it in module globals shared by every run of
    the process; the run writes to its sinks before any ``posttrain_step_end`` observer acts
    on the step (an observer may stop or kill the run, and the step's metrics must be on
    disk by then), whatever order pluggy calls hooks in; a sink that cannot open fails at
    once, before workers start; and sinks are named, listed by ``posttrain plugins`` and
    refused when registered twice, like every other seam.
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

    A policy backend's section (``policy.<backend>``) may define ``replica_factors(self) ->
    list[tuple[str, int]]``: the ``(config key, size)`` of the parallel dimensions it adds to
    one data-parallel replica beyond ``policy.tensor_parallel_size`` (e.g. megatron's
    pipeline and context parallel sizes). Core divides ``policy.num_workers`` by their
    product (:attr:`posttrain.config.schema.RunConfig.data_parallel_size`) and names those
    keys in its checks. Its class may declare features as class attributes set true
    (:mod:`posttrain.config.features`): ``supports_lora`` (the backend implements
    ``policy.lora``; core refuses LoRA with any other backend); a generation backend's section
    (``generation.<backend>``) ``supports_lora_adapters`` (its engines load the adapters a refit
    with ``policy.lora.refit: adapter`` sends).

    An algorithm's section (named like the algorithm) may define ``batch_size_rules(self) ->
    posttrain.config.validate.BatchSizeRules``: what its batches need beyond core's rules
    (GRPO: the global batch divides a step's samples; DPO: whole pairs per microbatch). Core
    checks every rule together, and a suggested fix satisfies all of them at once. It may
    also name, in a ``reads_sections`` class attribute, other algorithms' top-level sections
    its runs read (PPO runs GRPO's loop with the ``grpo`` section), which ``posttrain config
    show`` then lists for it.

    The algorithm's section, and a selected backend's or data plane's, may define
    ``cluster_demands(self, config) -> list[posttrain.config.demands.Demand]``: what the
    parts it starts hold of the Ray cluster for the whole run (an algorithm: the worker
    groups of the models it trains and of its engines; TransferQueue: its actors). Core adds
    them up and refuses, before Ray starts, a run whose parts do not fit its cluster
    together (:mod:`posttrain.config.demands`).
    """


@hookspec
def posttrain_validate_config(config: RunConfig) -> None:
    """Check a fully structured config before any worker starts.

    Raise :class:`posttrain.errors.ConfigError` naming the key, what was expected and what
    was found (with the numbers, for batch-size arithmetic). Called once per run, after
    every section is typed; return nothing when the config is acceptable. Every installed
    plugin is asked: a backend checks its section only when ``config.policy.backend`` (or
    ``generation.backend``) names it, an algorithm only when ``config.algorithm`` does.
    Append ``posttrain.config.where_set(config, key, ...)`` to a message to say in which file
    and line (or command-line override) each key was set. Core's own checks (sizes at least
    1, workers divisible by the model-parallel sizes, batch sizes divisible by the
    micro-batch and data-parallel sizes) run first. ``policy.scheduler.total_steps`` may
    still be unset here: the run fills it with its length before building the policy.
    """


# --------------------------------------------------------------------------- run lifecycle


@hookspec
def posttrain_run_start(config: RunConfig, run_dir: str) -> None:
    """Called once when a run starts, after its inputs are checked and its metric sinks
    opened (:func:`posttrain_metric_sinks`), before the first step. ``run_dir`` is where
    the run writes its outputs."""


@hookspec
def posttrain_step_end(step: int, metrics: Mapping[str, float], phase: str) -> None:
    """Called after every training step (``phase == "train"``) and every validation pass
    (``phase == "validation"``) with that step's scalar metrics.

    ``step`` counts training steps from 1 (a validation pass before the first is step 0).
    Called after every metric sink has written the step (sinks register with
    :func:`posttrain_metric_sinks`). Observers (early stoppers, alerting, fault injection)
    implement this; they must not mutate ``metrics``.
    """


@hookspec
def posttrain_run_end(config: RunConfig, run_dir: str, status: str) -> None:
    """Called once when a run ends; ``status`` is ``"completed"``, ``"interrupted"`` or
    ``"failed"``. The run's metric sinks are closed right after this hook."""
