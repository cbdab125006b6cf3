"""Environments hosted in Ray actors or in the driver, and containment of environments that
misbehave.

Each environment named by a run's tasks runs in its own Ray actor
(:class:`RemoteEnvironment`), or in the driver's process (:class:`LocalEnvironment`) where
``environments.<name>.in_driver`` says so (left null: where its factory declares itself light,
:func:`~posttrain.config.environments.runs_in_driver`). It is built by name from that
process's plugin host with the options under ``environments.<name>``, read as
:mod:`posttrain.config.environments` says: core's own keys (``call_timeout_s``,
``call_retries``, ``max_failed_fraction``, ``in_driver``) are read here and not passed on; the
rest go to the environment's factory, checked against the options class it declares. Either
way a call passes its deadline the same way: the environment is dropped (its actor stopped,
or its call left running in the driver) and the next call builds a fresh one.

Containment (:func:`step_contained`, used by the rollout). A failed environment call never
becomes a reward:

- a call whose actor died, or that passed its deadline (the actor is then stopped), is made
  again on a fresh actor, at most ``call_retries`` times per :func:`step_contained`;
- a call that raised or returned a malformed result is split in halves, each scored on its
  own, down to single samples, so that a sample the environment cannot score fails alone and
  its neighbours are scored;
- a sample still unscored after that, or one the environment itself reports in
  ``EnvironmentReturn.errors``, is *failed*: its ``errors`` entry holds why, its reward is 0
  and its episode ends; the rollout marks it (``failed``) so that no loss trains on it.

The counts become rollout metrics (in samples): ``env/<name>/retried`` (samples sent again),
``env/<name>/errors`` and ``env/<name>/timeouts`` (samples failed, by cause). An actor that
died with its node (:class:`~posttrain.errors.NodeLost`) is not contained: the run stops,
naming the node.
"""

from __future__ import annotations

import abc
import functools
import importlib
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from posttrain.config.environments import (
    CoreEnvironmentOptions,
    declares_runs_in_driver,
    read_core_options,
    read_environment_options,
    required_metadata,
)
from posttrain.config.validate import where_set
from posttrain.errors import ConfigError, DataError, NodeLost, PluginError, PosttrainError, WorkerError
from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain.log import get_logger
from posttrain.plugins import PluginHost, Registry, new_plugin_host, plugin_host

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.data import TokenizedDataset
    from posttrain.data.mixture import MixedDataset

_log = get_logger(__name__)


class EnvironmentTimeout(PosttrainError):
    """An environment call did not return within its deadline."""


class EnvironmentFailed(PosttrainError):
    """More of a rollout's samples failed in an environment than its
    ``max_failed_fraction`` allows."""


# ----------------------------------------------------------------------------- containment


@attrs.frozen
class ContainedStep:
    """A step's result, one entry per sample in every field; a failed sample has its reason
    in ``result.errors`` (None for the others), reward 0, and is terminated."""

    result: EnvironmentReturn
    errors: int  # samples failed by an exception, a malformed result, a dead actor or a per-sample error
    timeouts: int  # samples failed by calls past their deadline
    retried: int = 0  # samples sent again: on a fresh actor, or in a smaller call to isolate a failing one

    @property
    def failed(self) -> list[bool]:
        """Per sample: the environment could not score it."""
        return [error is not None for error in self.result.errors]


def step_contained(
    name: str, env: Environment, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any],
    *, call_retries: int = 0,
) -> ContainedStep:
    """``env.step`` with failures contained as the module docstring says; ``call_retries``
    bounds the calls made again after a dead actor or a deadline."""
    return _Containment(name, env, message_logs, metadata, call_retries).run()


class _Containment:
    """One contained step: scores sets of samples, retrying and splitting as needed, and
    keeps each sample's part of the results it got."""

    def __init__(self, name: str, env: Environment, logs: Sequence[Sequence[Message]], metadata: Sequence[Any], retries: int):
        self.name, self.env, self.logs, self.metadata = name, env, logs, metadata
        self.retries_left = retries
        self.parts: list[tuple[list[int], EnvironmentReturn]] = []
        self.timeouts = self.retried = 0

    def run(self) -> ContainedStep:
        self.score(list(range(len(self.logs))))
        result = _merge_returns(self.parts, len(self.logs))
        failed = sum(error is not None for error in result.errors)
        return ContainedStep(result, failed - self.timeouts, self.timeouts, self.retried)

    def score(self, indices: list[int]) -> None:
        try:
            result = self.env.step([self.logs[i] for i in indices], [self.metadata[i] for i in indices])
            check_return(self.name, result, len(indices))
        except NodeLost:
            raise
        except (EnvironmentTimeout, WorkerError) as exc:  # the actor is gone: a fresh one may answer
            if self.retries_left > 0:
                self.retries_left -= 1
                self.retried += len(indices)
                _log.warning("environment call failed; making it again on a fresh actor", environment=self.name,
                             samples=len(indices), retries_left=self.retries_left, error=_described(exc))
                self.score(indices)
                return
            self.fail(indices, _described(exc), timeout=isinstance(exc, EnvironmentTimeout))
        except Exception as exc:  # the environment raised, or answered wrongly: find the samples it fails on
            if len(indices) > 1:
                half = len(indices) // 2
                self.retried += len(indices)
                for part in (indices[:half], indices[half:]):
                    self.score(part)
                return
            self.fail(indices, _described(exc), timeout=False)
        else:
            self.parts.append((indices, _with_failures_contained(result)))

    def fail(self, indices: list[int], error: str, *, timeout: bool) -> None:
        if timeout:
            self.timeouts += len(indices)
        self.parts.append((indices, failed_return([self.metadata[i] for i in indices], error)))


def check_failures(
    name: str, options: CoreEnvironmentOptions, failures: Sequence[tuple[str | None, str]], total: int
) -> None:
    """Log the samples of environment ``name`` that failed in a rollout of ``total`` of its
    samples (``failures``: each one's data row and error), and raise
    :class:`EnvironmentFailed` when they are more than ``options.max_failed_fraction`` of it."""
    if not failures:
        return
    rows = list(dict.fromkeys(origin or "a sample" for origin, _ in failures))
    first_row, first_error = failures[0][0], " ".join(failures[0][1].split())
    _log.warning("environment could not score samples; they are left out of the loss", environment=name,
                 samples=len(failures), of=total, rows=rows[:5], more_rows=max(0, len(rows) - 5), first_error=first_error)
    if len(failures) <= options.max_failed_fraction * total:
        return
    raise EnvironmentFailed(
        f"environment '{name}' could not score {len(failures)} of {total} samples of a rollout, more than "
        f"environments.{name}.max_failed_fraction={options.max_failed_fraction:g} allows (a call whose actor died or "
        f"timed out was made again up to environments.{name}.call_retries={options.call_retries} times). The first: "
        f"{first_row or 'a sample'}: {first_error}. A sample the environment could not score is never trained on, so "
        f"the run stops rather than go on with so few. Fix the environment or the rows named, or set "
        f"environments.{name}.max_failed_fraction: 1.0 to train on the samples it scores."
    )


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _with_failures_contained(result: EnvironmentReturn) -> EnvironmentReturn:
    """``result`` with the samples it reports in ``errors`` scored 0 (their reward parts too)
    and terminated."""
    failed = [i for i, error in enumerate(result.errors) if error is not None]
    if not failed:
        return result
    rewards, terminateds = result.rewards.clone(), result.terminateds.clone()
    rewards[failed] = 0.0
    terminateds[failed] = True
    components = {name: values.clone().index_fill_(0, torch.tensor(failed), 0.0)
                  for name, values in result.reward_components.items()}
    return attrs.evolve(result, rewards=rewards, terminateds=terminateds, reward_components=components)


def _merge_returns(parts: Sequence[tuple[Sequence[int], EnvironmentReturn]], num_samples: int) -> EnvironmentReturn:
    """One :class:`EnvironmentReturn` of ``num_samples`` samples from results of calls on
    sets of them (``(indices, result)``, every sample in exactly one set): ``answers`` and
    ``errors`` always one entry per sample (None where a part had none), a reward part that
    some call did not report 0 for its samples."""
    if len(parts) == 1 and list(parts[0][0]) == list(range(num_samples)):
        result = parts[0][1]
        return attrs.evolve(result, answers=result.answers or [None] * num_samples,
                            errors=result.errors or [None] * num_samples)
    observations: list[Any] = [None] * num_samples
    metadata: list[Any] = [None] * num_samples
    stops: list[Any] = [None] * num_samples
    answers: list[str | None] = [None] * num_samples
    errors: list[str | None] = [None] * num_samples
    rewards = torch.zeros(num_samples, dtype=torch.float32)
    terminateds = torch.zeros(num_samples, dtype=torch.bool)
    names = sorted({name for _, result in parts for name in result.reward_components})
    components = {name: torch.zeros(num_samples, dtype=torch.float32) for name in names}
    for indices, result in parts:
        for k, i in enumerate(indices):
            observations[i], metadata[i], stops[i] = result.observations[k], result.metadata[k], result.next_stop_strings[k]
            answers[i] = result.answers[k] if result.answers else None
            errors[i] = result.errors[k] if result.errors else None
        index = torch.tensor(list(indices), dtype=torch.long)
        rewards[index] = result.rewards.to(torch.float32)
        terminateds[index] = result.terminateds.to(torch.bool)
        for name, values in result.reward_components.items():
            components[name][index] = values.to(torch.float32)
    return EnvironmentReturn(observations, metadata, stops, rewards, terminateds, answers, errors, components)


def check_return(name: str, result: Any, num_samples: int) -> None:
    """Raise :class:`PluginError` unless ``result`` is an :class:`EnvironmentReturn` with one
    entry per sample in every field (``answers`` and ``errors`` may also be empty)."""
    if not isinstance(result, EnvironmentReturn):
        raise PluginError(f"environment '{name}' returned {type(result).__name__} from step(); expected an EnvironmentReturn")
    fields = {
        "observations": result.observations,
        "metadata": result.metadata,
        "next_stop_strings": result.next_stop_strings,
        "rewards": result.rewards,
        "terminateds": result.terminateds,
        "answers": result.answers or [None] * num_samples,
        "errors": result.errors or [None] * num_samples,
        **{f"reward_components['{name}']": values for name, values in result.reward_components.items()},
    }
    for field, value in fields.items():
        if isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() == 1):
            if len(value) == num_samples:
                continue
            found = str(len(value))
        else:
            found = f"a {type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''} of"
        raise PluginError(
            f"environment '{name}' returned {found} {field} for {num_samples} message logs; "
            f"expected one per message log ({num_samples})"
        )


def failed_return(metadata: Sequence[Any], error: str) -> EnvironmentReturn:
    """The result standing in for a failed call: reward 0, terminated, metadata unchanged."""
    n = len(metadata)
    return EnvironmentReturn.final(torch.zeros(n), metadata, answers=[None] * n, errors=[error] * n)


def metrics_contained(name: str, env: Environment, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
    """``env.metrics``, or ``{}`` (with a warning) when it fails."""
    try:
        return {str(k): float(v) for k, v in env.metrics(rewards, metadata).items()}
    except NodeLost:
        raise
    except Exception as exc:  # metrics are informative; losing them must not stop the run
        _log.warning("environment metrics failed", environment=name, error=f"{type(exc).__name__}: {exc}")
        return {}


# ----------------------------------------------------------------------------- Ray actors


def host_with(plugins: Sequence[str] = ()) -> PluginHost:
    """This process's plugin host, or with extra plugin modules (importable names, e.g. a
    project's own environments) a fresh host that also registers them."""
    if not plugins:
        return plugin_host()
    host = new_plugin_host()
    for module in plugins:
        host.register(importlib.import_module(module), name=module)
    return host


class EnvironmentActor:
    """The object inside an environment's Ray actor: builds the environment by name.

    A failure to build it is kept and raised by :meth:`ready`, so the driver sees the
    original error (e.g. a :class:`~posttrain.errors.ConfigError` about an option).
    """

    def __init__(self, name: str, options: Mapping[str, Any], plugins: Sequence[str]):
        self._error: BaseException | None = None
        self.env: Environment | None = None
        try:
            self.env = host_with(plugins).environments[name](dict(options))
        except Exception as exc:  # raised to the driver by ready()
            self._error = exc

    def ready(self) -> None:
        if self._error is not None:
            raise self._error

    def node_id(self) -> str:
        """The id of the Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        assert self.env is not None, "ready() failed; the actor has no environment"
        return self.env.step(message_logs, metadata)

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        assert self.env is not None, "ready() failed; the actor has no environment"
        return self.env.metrics(rewards, metadata)

    def tool_schemas(self) -> list[dict[str, Any]]:
        assert self.env is not None, "ready() failed; the actor has no environment"
        return self.env.tool_schemas()

    def shutdown(self) -> None:
        if self.env is not None:
            self.env.shutdown()


class _HostedEnvironment(Environment):
    """An environment built by name from ``environments.<name>`` where a subclass runs it,
    every call under a deadline (``call_timeout_s``); :meth:`_call` makes the calls."""

    def __init__(self, name: str, options: Mapping[str, Any] | None, plugins: Sequence[str]):
        core, self._options = read_core_options(name, options)
        self.name = name
        self.core_options = core
        self.call_timeout_s = core.call_timeout_s
        self._plugins = tuple(plugins)
        self._tools: list[dict[str, Any]] | None = None

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        """The environment's step; raises :class:`EnvironmentTimeout` past ``call_timeout_s``."""
        return self._call("step", list(message_logs), list(metadata))

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        return self._call("metrics", rewards, list(metadata))

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The environment's tools, asked once (they do not change during a run)."""
        if self._tools is None:
            self._tools = self._call("tool_schemas")
        return self._tools

    @abc.abstractmethod
    def _call(self, method: str, *args: Any) -> Any:
        """The :class:`EnvironmentActor` method ``method`` called with ``args``, under the deadline."""

    def _start_failure(self, cause: BaseException) -> PosttrainError:
        """What building the environment raised, as the driver raises it: posttrain's own
        errors as they are, anything else named as this environment's failure to start."""
        if isinstance(cause, PosttrainError):
            return cause
        return PluginError(f"environment '{self.name}' failed to start: {type(cause).__name__}: {cause}")

    def _timed_out(self, method: str, where: str) -> EnvironmentTimeout:
        return EnvironmentTimeout(
            f"environment '{self.name}' did not answer {method}() within {self.call_timeout_s:g} s "
            f"(environments.{self.name}.call_timeout_s); {where} and the next call starts a fresh one"
        )


class LocalEnvironment(_HostedEnvironment):
    """An environment in this (the driver's) process (``environments.<name>.in_driver``),
    built by the constructor in the :class:`EnvironmentActor` object a Ray actor would hold.
    Each call runs on a daemon thread of its own, one at a time (as an actor takes them);
    past ``call_timeout_s`` the call is left running, the environment is dropped, and the
    next call builds a fresh one. A dropped environment is shut down when its hung call ends,
    or at the latest by :meth:`shutdown` (:class:`_Dropped`). ``plugins`` as for
    :func:`host_with`."""

    def __init__(self, name: str, options: Mapping[str, Any] | None = None, *, plugins: Sequence[str] = ()):
        super().__init__(name, options, plugins)
        self._lock = threading.Lock()
        self._actor: EnvironmentActor | None = None
        self._dropped: list[_Dropped] = []
        self._start()

    def shutdown(self) -> None:
        """Let the environment, and every one dropped after a deadline whose call still runs,
        free its resources. Safe to call twice."""
        actor, self._actor = self._actor, None
        if actor is not None:
            actor.shutdown()
        for dropped in self._dropped:
            dropped.shut_down()

    def _start(self) -> None:
        actor = EnvironmentActor(self.name, self._options, self._plugins)
        try:
            actor.ready()
        except Exception as exc:
            failure = self._start_failure(exc)
            raise failure from (None if failure is exc else exc)
        self._actor = actor

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._actor is None:  # dropped after a deadline: build a fresh one
                self._start()
            actor, outcome = self._actor, {}

            def call() -> None:
                try:
                    outcome["value"] = getattr(actor, method)(*args)
                except BaseException as exc:  # raised below, in the caller's thread
                    outcome["error"] = exc

            thread = threading.Thread(target=call, name=f"posttrain-env-{self.name}", daemon=True)
            thread.start()
            thread.join(self.call_timeout_s)
            if thread.is_alive():
                self._actor = None
                self._dropped.append(_Dropped(self.name, actor, thread))
                raise self._timed_out(method, "the call was left running in the driver")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


class _Dropped:
    """An in-driver environment dropped while a call of it ran past its deadline (Python cannot
    stop the call's thread): shut down by a daemon thread once the call ends, or earlier by
    :meth:`shut_down` (its :class:`LocalEnvironment` shutting down: releasing what it holds,
    e.g. worker processes, may end the call), whichever comes first; once."""

    def __init__(self, name: str, actor: EnvironmentActor, call: threading.Thread):
        self._name = name
        self._actor: EnvironmentActor | None = actor
        self._lock = threading.Lock()
        threading.Thread(target=self._after, args=(call,), name=f"posttrain-env-{name}-dropped", daemon=True).start()

    def _after(self, call: threading.Thread) -> None:
        call.join()
        self.shut_down()

    def shut_down(self) -> None:
        with self._lock:
            actor, self._actor = self._actor, None
        if actor is None:
            return
        try:
            actor.shutdown()
        except Exception as exc:  # nothing waits for it: report, do not raise into a daemon thread
            _log.warning("a dropped environment failed to shut down", environment=self._name,
                         error=f"{type(exc).__name__}: {exc}")


class RemoteEnvironment(_HostedEnvironment):
    """An :class:`Environment` running in a Ray actor, with a deadline on every call.

    The actor is started (and its environment built) by the constructor, which raises the
    environment's own error when building fails. ``actor_options`` go to Ray's
    ``.options()`` (default ``num_cpus=0``: environments are light and must not hold back
    training workers; give a heavy one CPUs here). ``plugins`` are extra plugin modules to
    register in the actor (see :func:`host_with`).
    """

    def __init__(
        self,
        name: str,
        options: Mapping[str, Any] | None = None,
        *,
        plugins: Sequence[str] = (),
        actor_options: Mapping[str, Any] | None = None,
        start_timeout_s: float = 300.0,
    ):
        super().__init__(name, options, plugins)
        self._node: str | None = None  # the Ray node of the actor, once started
        self._actor_options = {"num_cpus": 0, **(actor_options or {})}
        self._start_timeout_s = start_timeout_s
        self._actor: Any = None
        self._start()

    def shutdown(self) -> None:
        """Let the environment free its resources, then stop the actor. Safe to call twice."""
        if self._actor is None:
            return
        import ray

        try:
            ray.get(self._actor.shutdown.remote(), timeout=30)
        except Exception as exc:  # the actor goes away regardless
            _log.warning("environment shutdown failed", environment=self.name, error=f"{type(exc).__name__}: {exc}")
        ray.kill(self._actor)
        self._actor = None

    def _start(self) -> None:
        import ray

        actor_cls = _remote_actor_class()
        self._actor = actor_cls.options(**self._actor_options).remote(self.name, self._options, self._plugins)
        try:
            ray.get(self._actor.ready.remote(), timeout=self._start_timeout_s)
            self._node = ray.get(self._actor.node_id.remote(), timeout=self._start_timeout_s)
        except ray.exceptions.RayTaskError as exc:  # building the environment raised
            self._kill()
            raise self._start_failure(exc.cause) from None
        except ray.exceptions.GetTimeoutError:
            self._kill()
            raise EnvironmentTimeout(f"environment '{self.name}' did not start within {self._start_timeout_s:g} s") from None
        except ray.exceptions.RayActorError as exc:
            self._actor = None
            raise WorkerError(f"environment '{self.name}' actor died while starting: {exc}") from None

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        if self._actor is None:  # killed after a timeout or a crash: start a fresh one
            self._start()
        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill()
            raise self._timed_out(method, "its actor was stopped") from None
        except ray.exceptions.RayActorError as exc:
            self._actor = None
            from posttrain.distributed.nodes import node_dead, node_label

            if self._node is not None and node_dead(self._node):
                raise NodeLost(
                    f"environment '{self.name}' died on node {node_label(self._node)} during {method}(): "
                    f"{' '.join(str(exc).split())}"
                ) from None
            raise WorkerError(f"environment '{self.name}' actor died during {method}(): {exc}") from None

    def _kill(self) -> None:
        import ray

        ray.kill(self._actor)
        self._actor = None


def core_options(env: Environment) -> CoreEnvironmentOptions:
    """The core options an environment runs under: its ``core_options`` attribute when it has
    one (a :class:`RemoteEnvironment`: ``environments.<name>``), else the defaults."""
    options = getattr(env, "core_options", None)
    return options if isinstance(options, CoreEnvironmentOptions) else CoreEnvironmentOptions()


@functools.cache
def _remote_actor_class() -> Any:
    import ray

    return ray.remote(EnvironmentActor)


def start_environments(
    names: Iterable[str],
    options: Mapping[str, Mapping[str, Any]],
    *,
    plugins: Sequence[str] = (),
    actor_options: Mapping[str, Any] | None = None,
) -> dict[str, Environment]:
    """One environment per name in ``names``, with ``options[name]``: a
    :class:`LocalEnvironment` in this process where ``environments.<name>.in_driver`` says so
    (left null: where the factory declares :func:`~posttrain.config.environments.runs_in_driver`),
    else a :class:`RemoteEnvironment` in an actor of its own.

    Every name in ``names`` and in ``options`` (``config.environments``) must be registered
    and its options valid: an unknown name raises the host's unknown-name
    :class:`PluginError`, a bad option a :class:`~posttrain.errors.ConfigError`, before any
    actor starts. If one environment fails to start, those already started are shut down.
    """
    names = list(dict.fromkeys(names))
    registry = host_with(plugins).environments
    read = {
        # raises "unknown environment 'mth'; installed: ... Did you mean 'math'?"
        name: read_environment_options(name, registry[name], options.get(name))
        for name in dict.fromkeys([*names, *options])
    }
    started: dict[str, Environment] = {}
    try:
        for name in names:
            in_driver = read[name].core.in_driver
            if in_driver is None and declares_runs_in_driver(registry[name]):
                _log.info("environment in the driver's process", environment=name,
                          setting=f"environments.{name}.in_driver: null")
                in_driver = True
            if in_driver:
                started[name] = LocalEnvironment(name, options.get(name, {}), plugins=plugins)
            else:
                started[name] = RemoteEnvironment(name, options.get(name, {}), plugins=plugins,
                                                  actor_options=actor_options)
    except BaseException:
        for env in started.values():
            env.shutdown()
        raise
    return started


def environment_names(
    config: RunConfig, datasets: Sequence[TokenizedDataset | MixedDataset | None], *, plugins: Sequence[str] = ()
) -> tuple[list[str], str | None]:
    """The environments a rollout of ``datasets`` (prompt data; a mixture's every source) needs: every ``task`` the rows
    name plus every name under ``environments``, sorted; and the task of rows that name none
    (the only environment, or None when every row names its task).

    Every name must be registered (in this process's plugin host, plus the extra plugin
    modules ``plugins``), and every row must hold the metadata its environment needs
    (:func:`check_required_metadata`), checked here, before Ray or any worker starts: an
    unknown task or a missing key names the config key of its data, the file and the row."""
    registry = host_with(plugins).environments
    for name in config.environments:
        if name not in registry:
            raise ConfigError(
                f"environments.{name}: {registry.unknown_message(name)}{where_set(config, f'environments.{name}')}"
            )
    parts = [part for dataset in datasets if dataset is not None for part in dataset.parts]
    tasks: set[str | None] = set()
    for dataset in parts:
        for task, row in zip(dataset.table["task"], dataset.table["row"], strict=True):
            if task and task not in registry:
                key = dataset.report.key or "the data"
                raise ConfigError(
                    f"{key} ({dataset.report.source}) row {row}, key 'task': {registry.unknown_message(task)} "
                    f"Correct the row's task, or install the plugin that provides "
                    f"'{task}'.{where_set(config, key)}"
                )
            tasks.add(task)
    names = sorted({*config.environments, *(task for task in tasks if task)})
    if not names:
        raise ConfigError(
            f"{config.algorithm or 'a rollout'} needs an environment to score responses, but the data rows name no "
            "'task' and the config has no 'environments' section; add e.g. 'environments: {math: {}}' or a 'task' "
            "to every data row"
        )
    default = None
    if None in tasks or "" in tasks:
        if len(names) > 1:
            raise ConfigError(
                f"some data rows have no 'task', and there are {len(names)} environments ({', '.join(names)}) they "
                "could go to; give every row a 'task', or configure exactly one environment under 'environments'"
            )
        default = names[0]
    for dataset in parts:
        check_required_metadata(config, dataset, registry, default)
    return names, default


def check_required_metadata(
    config: RunConfig, dataset: TokenizedDataset, registry: Registry, default_task: str | None
) -> None:
    """Every row of ``dataset`` has the metadata its environment declared it needs
    (:func:`~posttrain.config.environments.requires_metadata`): a row's metadata, with its
    ``answer``. Rows that lack some are left out with ``data.skip_malformed`` (logged and
    counted); otherwise the first is named, with how many more, in a :class:`DataError`."""
    needs: dict[str, dict[str, str]] = {}
    problems: dict[int, str] = {}
    table = dataset.table
    for task, row, meta_json, answer_json in zip(table["task"], table["row"], table["metadata"], table["answer"], strict=True):
        name = task or default_task
        if name is None:
            continue
        if name not in needs:
            needs[name] = required_metadata(registry[name])
        if not needs[name]:
            continue
        meta, answer = json.loads(meta_json), json.loads(answer_json)
        meta = {"answer": answer, **meta} if answer is not None else meta
        missing = [key for key in needs[name] if meta.get(key) is None]
        if missing:
            described = ", ".join(f"'{key}' ({needs[name][key]})" for key in missing)
            problems[row] = (
                f"the {name} environment needs {described} in each of its rows, and this row has "
                f"{'none' if len(missing) == 1 else 'none of them'} (its metadata keys: {', '.join(sorted(meta)) or 'none'})"
            )
    if not problems:
        return
    if config.data.skip_malformed:
        dataset.drop_rows(problems)
        return
    key = dataset.report.key or "the data"
    rows = sorted(problems)
    more = rows[1:]
    lack = "rows lack what their environment needs" if len(more) > 1 else "row lacks what its environment needs"
    others = f"; {len(more)} more {lack}: {', '.join(map(str, more[:10]))}{', ...' if len(more) > 10 else ''}" if more else ""
    raise DataError(
        f"{key} ({dataset.report.source}) row {rows[0]}: {problems[rows[0]]}{others}. Add the keys to "
        f"{'these rows' if more else 'the row'} (as keys of the row, or under its 'metadata'), remove "
        f"{'them' if more else 'it'}, or set data.skip_malformed: true to leave such rows out.{where_set(config, key)}"
    )


def shutdown_environments(environments: Mapping[str, Environment]) -> None:
    """Shut down every environment of a mapping :func:`start_environments` returned."""
    for env in environments.values():
        env.shutdown()
