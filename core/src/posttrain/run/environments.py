"""Environments hosted in Ray actors, and containment of environments that misbehave.

Each environment named by a run's tasks runs in its own Ray actor
(:class:`RemoteEnvironment`), built there by name from that process's plugin host with the
options under ``environments.<name>``, read as :mod:`posttrain.config.environments` says:
core's own keys (``call_timeout_s``, the deadline of one call to the actor) are read here and
not passed on; the rest go to the environment's factory, checked against the options class
it declares.

Containment (:func:`step_contained`, used by the rollout): an environment call that raises,
returns results of the wrong length, or passes its deadline gives every sample of that call
reward 0 and ends those samples; a sample the environment itself reports in
``EnvironmentReturn.errors`` is the only one lost. The run goes on; the counts become the
rollout metrics ``env/<name>/errors`` and ``env/<name>/timeouts`` (in samples). After a
timeout the actor is killed and a fresh one is started on the next call. An actor that died
with its node (:class:`~posttrain.errors.NodeLost`) is not contained: the run stops, naming
the node.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from posttrain.config.environments import read_core_options, read_environment_options
from posttrain.config.validate import where_set
from posttrain.errors import ConfigError, NodeLost, PluginError, PosttrainError, WorkerError
from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain.log import get_logger
from posttrain.plugins import PluginHost, new_plugin_host, plugin_host

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.data import TokenizedDataset

_log = get_logger(__name__)


class EnvironmentTimeout(PosttrainError):
    """An environment call did not return within its deadline."""


# ----------------------------------------------------------------------------- containment


@attrs.frozen
class ContainedStep:
    """A step's result with failures replaced, and how many samples were lost to each kind."""

    result: EnvironmentReturn
    errors: int  # samples lost to an exception, a malformed result or a per-sample error
    timeouts: int  # samples lost to a call past its deadline


def step_contained(name: str, env: Environment, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> ContainedStep:
    """``env.step`` with every failure turned into reward 0 and termination (see module doc)."""
    n = len(message_logs)
    try:
        result = env.step(message_logs, metadata)
        check_return(name, result, n)
    except EnvironmentTimeout as exc:
        _log.warning("environment call timed out", environment=name, samples=n, error=str(exc))
        return ContainedStep(failed_return(metadata, str(exc)), errors=0, timeouts=n)
    except NodeLost:
        raise
    except Exception as exc:  # contained: the run goes on with these samples scored 0
        message = f"{type(exc).__name__}: {exc}"
        _log.warning("environment call failed", environment=name, samples=n, error=message)
        return ContainedStep(failed_return(metadata, message), errors=n, timeouts=0)
    failed = [i for i, error in enumerate(result.errors) if error is not None]
    if not failed:
        return ContainedStep(result, errors=0, timeouts=0)
    _log.warning("environment failed on some samples", environment=name, samples=len(failed), first_error=result.errors[failed[0]])
    rewards, terminateds = result.rewards.clone(), result.terminateds.clone()
    rewards[failed] = 0.0
    terminateds[failed] = True
    components = {name: values.clone().index_fill_(0, torch.tensor(failed), 0.0)
                  for name, values in result.reward_components.items()}
    contained = attrs.evolve(result, rewards=rewards, terminateds=terminateds, reward_components=components)
    return ContainedStep(contained, errors=len(failed), timeouts=0)


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


class RemoteEnvironment(Environment):
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
        core, self._options = read_core_options(name, options)
        self.name = name
        self._node: str | None = None  # the Ray node of the actor, once started
        self.call_timeout_s = core.call_timeout_s
        self._plugins = tuple(plugins)
        self._actor_options = {"num_cpus": 0, **(actor_options or {})}
        self._start_timeout_s = start_timeout_s
        self._actor: Any = None
        self._tools: list[dict[str, Any]] | None = None
        self._start()

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
            cause = exc.cause
            if isinstance(cause, PosttrainError):
                raise cause from None
            raise PluginError(f"environment '{self.name}' failed to start: {type(cause).__name__}: {cause}") from None
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
            raise EnvironmentTimeout(
                f"environment '{self.name}' did not answer {method}() within {self.call_timeout_s:g} s "
                f"(environments.{self.name}.call_timeout_s); its actor was stopped and the next call starts a fresh one"
            ) from None
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
) -> dict[str, RemoteEnvironment]:
    """One :class:`RemoteEnvironment` per name in ``names``, with ``options[name]``.

    Every name in ``names`` and in ``options`` (``config.environments``) must be registered
    and its options valid: an unknown name raises the host's unknown-name
    :class:`PluginError`, a bad option a :class:`~posttrain.errors.ConfigError`, before any
    actor starts. If one environment fails to start, those already started are shut down.
    """
    names = list(dict.fromkeys(names))
    registry = host_with(plugins).environments
    for name in dict.fromkeys([*names, *options]):
        # raises "unknown environment 'mth'; installed: ... Did you mean 'math'?"
        read_environment_options(name, registry[name], options.get(name))
    started: dict[str, RemoteEnvironment] = {}
    try:
        for name in names:
            started[name] = RemoteEnvironment(name, options.get(name, {}), plugins=plugins, actor_options=actor_options)
    except BaseException:
        for env in started.values():
            env.shutdown()
        raise
    return started


def environment_names(
    config: RunConfig, datasets: Sequence[TokenizedDataset | None], *, plugins: Sequence[str] = ()
) -> tuple[list[str], str | None]:
    """The environments a rollout of ``datasets`` (prompt data) needs: every ``task`` the rows
    name plus every name under ``environments``, sorted; and the task of rows that name none
    (the only environment, or None when every row names its task).

    Every name must be registered (in this process's plugin host, plus the extra plugin
    modules ``plugins``), checked here, before Ray or any worker starts: an unknown task
    names the config key of its data, the file and the row."""
    registry = host_with(plugins).environments
    for name in config.environments:
        if name not in registry:
            raise ConfigError(
                f"environments.{name}: {registry.unknown_message(name)}{where_set(config, f'environments.{name}')}"
            )
    tasks: set[str | None] = set()
    for dataset in datasets:
        if dataset is None:
            continue
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
    if None not in tasks and "" not in tasks:
        return names, None
    if len(names) > 1:
        raise ConfigError(
            f"some data rows have no 'task', and there are {len(names)} environments ({', '.join(names)}) they "
            "could go to; give every row a 'task', or configure exactly one environment under 'environments'"
        )
    return names, names[0]


def shutdown_environments(environments: Mapping[str, Environment]) -> None:
    """Shut down every environment of a mapping :func:`start_environments` returned."""
    for env in environments.values():
        env.shutdown()
