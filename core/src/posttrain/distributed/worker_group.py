"""Worker groups: N Ray actors of one class that act as the ranks of one job.

Each actor runs in its own process, on a bundle of the group's placement group (ranks ordered
by node; ``ranks_per_bundle`` consecutive ranks share one node; see
:mod:`posttrain.distributed.placement`), with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in ``os.environ`` before the worker's ``__init__`` body runs, so
``torch.distributed.init_process_group(backend)`` with the default env init forms the
group. ``MASTER_ADDR`` is 127.0.0.1 when every rank is on one node, else rank 0's node
address; ``MASTER_PORT`` is a port that was free on rank 0's node when the group started
(when rank 0 finds it taken by then, the group starts again with another, up to
:data:`PORT_ATTEMPTS` times).
Errors about a rank name its node (:attr:`~posttrain.distributed.nodes.Node.label`); on a
cluster of several nodes, a ``workers placed`` event lists each rank's node.

Calls go to every rank (:meth:`WorkerGroup.run_all`), to each rank with its own shard
(:meth:`WorkerGroup.run_sharded`) or to rank 0 only (:meth:`WorkerGroup.run_rank0`). A call
names the method itself, e.g. ``group.run_all(PolicyWorker.save_checkpoint, path)``, never
a string: a type checker sees the arguments, and the group refuses a method its worker
class does not have (the rank runs its own override of it).
Results are gathered with :meth:`WorkerGroup.get`, which surfaces the first failure as a
:class:`~posttrain.errors.WorkerError` naming the group, the rank and the method, instead
of waiting on the ranks that are still running (they may be blocked in a collective
with the dead one).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.config.schema import WorkerResources
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.driver_rank import DriverCall, DriverRank, rank_threads
from posttrain.distributed.nodes import all_nodes, node_dead, node_label
from posttrain.distributed.placement import DevicePlacement, Placement, this_process_devices
from posttrain.errors import NodeLost, ProcessDied, WorkerError
from posttrain.log import get_logger
from posttrain.plugins import plugin_host

#: Starts of a group, each with a fresh ``MASTER_PORT``, when rank 0 finds the port taken: it
#: was free when the driver picked it, but another process (an outgoing connection's
#: ephemeral port, on a busy machine) may take it before rank 0 listens on it.
PORT_ATTEMPTS = 3
#: What torch.distributed's error says when rank 0 cannot listen on ``MASTER_PORT``.
PORT_TAKEN = "EADDRINUSE"
#: How long a failed call waits for the group's other pending calls before raising, so that
#: a rank that died (the usual reason a collective fails on its peers) is the one reported.
PEER_DEATH_GRACE_S = 5.0


class Worker:
    """Base class of every actor class in a worker group.

    ``__init__`` loads the ``posttrain`` entry-point plugins in the worker process, so
    registries (environments, losses, ...) hold every installed plugin there too.
    Subclasses call ``super().__init__()``. Outside a worker group (a plain object in a
    test) the rank is 0 of 1.
    """

    def __init__(self) -> None:
        plugin_host()

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def devices(self) -> DevicePlacement:
        """Where this worker computes: its node and the GPUs Ray gave it."""
        return this_process_devices()

    def run_work(self, work: Any, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``work.run(self, method, *args, **kwargs)``: let a work item wrap this worker's
        ``method`` in the worker's process (a :class:`~posttrain.backend.work.RankWork`
        that refers to a data plane stores the method's result there)."""
        return work.run(self, method, *args, **kwargs)


W = TypeVar("W", bound=Worker)
P = ParamSpec("P")
R = TypeVar("R")


def bound_method(worker: Worker, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a function of the worker's class or of a base class) bound to ``worker``:
    the worker's own override of it."""
    return getattr(worker, method.__name__)


class WorkerGroup(Generic[W]):
    """``num_workers`` actors of ``worker_cls`` on a placement group reserved from
    ``cluster`` under ``name`` (:meth:`VirtualCluster.reserve`), ``ranks_per_bundle``
    consecutive ranks on one node (e.g. ``policy.tensor_parallel_size``). A worker that asks
    for GPUs spans ``devices_per_worker`` of them: with more than one, its actor asks Ray for
    none and finds the bundles it starts its own processes on in its environment
    (:func:`~posttrain.distributed.placement.device_bundles`). An actor that asks for no GPU
    sees none (``CUDA_VISIBLE_DEVICES=""`` in a cluster started or joined by
    :func:`~posttrain.distributed.cluster.init_ray`).

    ``resources.env_vars`` and ``resources.runtime_env`` become the actors' Ray
    ``runtime_env`` (``env_vars`` merged into ``runtime_env["env_vars"]``), so a worker
    type can run in its own Python environment (``py_executable``, ``pip``, ...).
    ``worker_cls(*args, **kwargs)`` is constructed in every actor; the constructor
    returns once all ranks are ready, or raises :class:`WorkerError` naming the rank whose
    ``__init__`` failed (the group is shut down then).

    ``in_driver``: the group's single rank is a :class:`~posttrain.distributed.driver_rank.DriverRank`
    in this process instead of an actor (no GPU, and no ``runtime_env`` but ``env_vars``);
    its bundle is still reserved, so a group colocated with it is placed as usual. Its calls
    run when they are made: an ``*_async`` call returns after the work, its result (or
    error) held for :meth:`get`.
    """

    def __init__(
        self,
        cluster: VirtualCluster,
        worker_cls: type[W],
        *,
        name: str,
        num_workers: int,
        resources: WorkerResources,
        ranks_per_bundle: int = 1,
        devices_per_worker: int = 1,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        in_driver: bool = False,
    ):
        if in_driver:
            check_driver_rank(name, num_workers, resources)
        self.name = name
        self.cluster = cluster
        self.worker_cls = worker_cls
        self.world_size = num_workers
        self.actors: list[ray.actor.ActorHandle] = []
        self.driver_rank: DriverRank | None = None
        self.node_ids: list[str] = []
        self._calls: dict[str, tuple[int, str]] = {}  # ObjectRef hex -> (rank, method)
        self._closed = False
        placement = cluster.reserve(name, num_workers, resources, ranks_per_bundle=ranks_per_bundle,
                                    devices_per_worker=devices_per_worker)
        try:
            self.node_ids = list(placement.nodes)  # the Ray node of each rank
            if in_driver:
                self._start_in_driver(placement, resources, tuple(args), dict(kwargs or {}))
                return
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self.actors = self._start_actors(placement, resources, tuple(args), dict(kwargs or {}))
                try:
                    self.get([self._track(actor.__ray_ready__.remote(), rank, "__init__")
                              for rank, actor in enumerate(self.actors)])
                    break
                except WorkerError as error:
                    if PORT_TAKEN not in str(error) or attempt == PORT_ATTEMPTS:
                        raise
                    get_logger().warning("rendezvous port taken before rank 0 listened on it; starting the group "
                                         "again with another", group=name, attempt=attempt)
                    for actor in self.actors:
                        ray.kill(actor, no_restart=True)
        except BaseException:
            self.shutdown()
            raise
        if len(cluster.nodes) > 1:
            labels = {node.node_id: node.label for node in all_nodes()}
            get_logger().info("workers placed", group=name, nodes=[labels[node] for node in self.node_ids])

    # ------------------------------------------------------------------ calls

    def run_all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call ``method(*args, **kwargs)`` on every rank; results in rank order."""
        return self.get(self.run_all_async(method, *args, **kwargs))

    def run_sharded(
        self,
        method: Callable[..., R],
        shards: Sequence[Any],
        *args: Any,
        shard_of_rank: Callable[[int], int] | None = None,
        **kwargs: Any,
    ) -> list[R]:
        """Call ``method(shards[shard_of_rank(r)], *args, **kwargs)`` on each rank r.

        Without ``shard_of_rank`` rank r gets ``shards[r]`` and there must be exactly one
        shard per rank. With it, several ranks may share a shard (e.g. the tensor-parallel
        ranks of one data-parallel replica: ``lambda r: r // tp``); a shared shard is put
        in the object store once.
        """
        return self.get(self.run_sharded_async(method, shards, *args, shard_of_rank=shard_of_rank, **kwargs))

    def run_rank0(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Call ``method(*args, **kwargs)`` on rank 0 only and return its result."""
        return self.get(self.run_rank0_async(method, *args, **kwargs))

    def run_all_async(
        self, method: Callable[Concatenate[W, P], Any], *args: P.args, **kwargs: P.kwargs
    ) -> list[ray.ObjectRef]:
        """Like :meth:`run_all` but returns one ObjectRef per rank; resolve with :meth:`get`."""
        return [self._call(rank, method, args, kwargs) for rank in range(self.world_size)]

    def run_sharded_async(
        self,
        method: Callable[..., Any],
        shards: Sequence[Any],
        *args: Any,
        shard_of_rank: Callable[[int], int] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """Like :meth:`run_sharded` but returns one ObjectRef per rank; resolve with :meth:`get`."""
        name = self._method_name(method)
        if shard_of_rank is None and len(shards) != self.world_size:
            raise ValueError(
                f"worker group '{self.name}': run_sharded({name}) got {len(shards)} shards for "
                f"{self.world_size} ranks; pass one shard per rank or a shard_of_rank function"
            )
        pick = shard_of_rank or (lambda rank: rank)
        chosen = [pick(rank) for rank in range(self.world_size)]
        for rank, index in enumerate(chosen):
            if not 0 <= index < len(shards):
                raise ValueError(
                    f"worker group '{self.name}': shard_of_rank({rank}) = {index}, outside the "
                    f"{len(shards)} shards given to run_sharded({name})"
                )
        payload = {
            index: ray.put(shards[index])
            if chosen.count(index) > 1 and not isinstance(shards[index], ray.ObjectRef)
            else shards[index]
            for index in set(chosen)
        }
        return [self._call(rank, method, (payload[index], *args), kwargs) for rank, index in enumerate(chosen)]

    def run_rank0_async(
        self, method: Callable[Concatenate[W, P], Any], *args: P.args, **kwargs: P.kwargs
    ) -> ray.ObjectRef:
        """Like :meth:`run_rank0` but returns the ObjectRef; resolve with :meth:`get`."""
        return self._call(0, method, args, kwargs)

    def get(self, refs: ray.ObjectRef | Sequence[ray.ObjectRef], *, timeout_s: float | None = None) -> Any:
        """Wait for refs returned by this group's ``*_async`` calls and return their values
        (a list for a list, one value for one ref).

        The first call to fail raises :class:`WorkerError`: ``worker group 'NAME' rank R
        died on node NODE: ...`` when the actor process died (:class:`NodeLost` when the
        cluster marked that node dead), or
        ``worker group 'NAME' rank R: METHOD() raised ...`` with the last line of the remote
        traceback. When a call raised while others are pending, a rank among them that died
        within :data:`PEER_DEATH_GRACE_S` is reported instead (its death is what broke the
        others' collectives). Past ``timeout_s`` seconds it raises :class:`WorkerError`
        naming the unfinished ranks.
        """
        if isinstance(refs, DriverCall) or (isinstance(refs, list) and refs and isinstance(refs[0], DriverCall)):
            return self._driver_values(refs)
        single = isinstance(refs, ray.ObjectRef)
        ref_list: list[ray.ObjectRef] = [refs] if single else list(refs)  # type: ignore[list-item]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        values: dict[str, Any] = {}
        pending = list(ref_list)
        try:
            while pending:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
                if not ready:
                    late = ", ".join(f"rank {r} {m}()" for r, m in (self._owner(ref) for ref in pending))
                    raise WorkerError(f"worker group '{self.name}': {late} did not finish within {timeout_s:g} s")
                ref = ready[0]
                try:
                    values[ref.hex()] = self._value(ref)
                except WorkerError:
                    dead = self._dead_peer(pending)
                    if dead is None:
                        raise
                    raise dead from dead.__cause__
        finally:
            for ref in ref_list:
                self._calls.pop(ref.hex(), None)
        results = [values[ref.hex()] for ref in ref_list]
        return results[0] if single else results

    # ------------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` ran (no call can be made then)."""
        return self._closed

    def shutdown(self) -> None:
        """Kill every actor and release the placement group. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.driver_rank is not None:
            self.driver_rank.close()
        if ray.is_initialized():
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self.cluster.release(self.name)
        self._calls.clear()

    def __enter__(self) -> WorkerGroup[W]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _start_actors(
        self, placement: Placement, resources: WorkerResources, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[ray.actor.ActorHandle]:
        actor_cls = ray.remote(_actor_class(self.worker_cls))
        token = uuid.uuid4().hex[:6]
        return [
            actor_cls.options(name=f"{self.name}-rank{rank}-{token}", max_restarts=0,
                              **rank_options(placement, rank, resources)).remote(env, args, kwargs)
            for rank, env in enumerate(rank_environments(placement))
        ]

    def _start_in_driver(self, placement: Placement, resources: WorkerResources, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> None:
        env = {**rank_environments(placement)[0], **{k: str(v) for k, v in resources.env_vars.items()}}
        threads = rank_threads(resources.cpus, env.get("OMP_NUM_THREADS"))
        env["OMP_NUM_THREADS"] = str(threads)
        try:
            self.driver_rank = DriverRank(self.worker_cls, env, threads, args, kwargs)
        except Exception as error:
            raise WorkerError(f"worker group '{self.name}' rank 0: __init__() raised {_raised(error)}") from error

    def _driver_values(self, calls: DriverCall | Sequence[DriverCall]) -> Any:
        """The values of calls a driver rank made; the first failure as :class:`WorkerError`
        (:class:`ProcessDied` when the rank's call saw another process die)."""
        listed = [calls] if isinstance(calls, DriverCall) else list(calls)
        try:
            for call in listed:
                if call.error is not None:
                    _, method = self._owner(call)  # type: ignore[arg-type]
                    raise (ProcessDied if isinstance(call.error, ProcessDied) else WorkerError)(
                        f"worker group '{self.name}' rank 0: {method}() raised {_raised(call.error)}"
                    ) from call.error
        finally:
            for call in listed:
                self._calls.pop(call.hex(), None)
        values = [call.value for call in listed]
        return values if isinstance(calls, list) else values[0]

    def _method_name(self, method: Callable[..., Any]) -> str:
        """The name ``method`` has on the worker class; refuses strings and methods of other
        classes."""
        if isinstance(method, str):
            raise TypeError(
                f"worker group '{self.name}': call a worker method by the method itself, e.g. "
                f"group.run_all({self.worker_cls.__name__}.{method}), not by the string '{method}'"
            )
        name = getattr(method, "__name__", None)
        owner = getattr(method, "__qualname__", "").rpartition(".")[0]
        mro = {klass.__qualname__ for klass in self.worker_cls.__mro__}
        if not isinstance(name, str) or owner not in mro or not callable(getattr(self.worker_cls, name, None)):
            raise AttributeError(
                f"worker group '{self.name}': {getattr(method, '__qualname__', method)!r} is not a method of "
                f"{self.worker_cls.__name__} or of a class it inherits from"
            )
        return name

    def _call(
        self, rank: int, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ray.ObjectRef:
        name = self._method_name(method)
        if self._closed:
            raise WorkerError(f"worker group '{self.name}' is shut down; cannot call {name}()")
        if self.driver_rank is not None:
            return self._track(self.driver_rank.call(name, args, kwargs), rank, name)  # type: ignore[arg-type]
        return self._track(getattr(self.actors[rank], name).remote(*args, **kwargs), rank, name)

    def _track(self, ref: ray.ObjectRef, rank: int, method: str) -> ray.ObjectRef:
        self._calls[ref.hex()] = (rank, method)
        return ref

    def _node_of(self, rank: int | str) -> str:
        """The node rank ``rank`` was placed on, as messages name it."""
        return node_label(self.node_ids[rank]) if isinstance(rank, int) and rank < len(self.node_ids) else "unknown"

    def _owner(self, ref: ray.ObjectRef) -> tuple[int | str, str]:
        return self._calls.get(ref.hex(), ("?", "?"))

    def _dead_peer(self, pending: list[ray.ObjectRef]) -> WorkerError | None:
        """The error of a rank among ``pending`` whose process died, waiting at most
        :data:`PEER_DEATH_GRACE_S` for them; None when none died."""
        if not pending:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
        for ref in ready:
            try:
                self._value(ref)
            except WorkerError as error:
                if actor_died(error.__cause__):
                    return error
        return None

    def _value(self, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            rank, method = self._owner(ref)
            if err.actor_init_failed:
                raise WorkerError(
                    f"worker group '{self.name}' rank {rank}: __init__() raised {_last_line(str(err))}"
                ) from err
            lost = isinstance(rank, int) and rank < len(self.node_ids) and node_dead(self.node_ids[rank])
            raise (NodeLost if lost else WorkerError)(
                f"worker group '{self.name}' rank {rank} died on node {self._node_of(rank)}: {_one_line(str(err))}"
            ) from err
        except ray.exceptions.RayTaskError as err:
            rank, method = self._owner(ref)
            raise (ProcessDied if isinstance(err.cause, ProcessDied) else WorkerError)(
                f"worker group '{self.name}' rank {rank}: {method}() raised {_last_line(str(err))}"
            ) from err


def actor_died(error: BaseException | None) -> bool:
    """Whether ``error`` is Ray's word that an actor's process died after it had started (not
    an ``__init__`` that raised)."""
    return isinstance(error, ray.exceptions.RayActorError) and not error.actor_init_failed


def check_driver_rank(name: str, num_workers: int, resources: WorkerResources) -> None:
    """Refuse a group that cannot run as one rank in the driver's process."""
    unsupported = sorted(set(resources.runtime_env) - {"env_vars"})
    if num_workers != 1 or resources.gpus > 0 or unsupported:
        found = (f"{num_workers} workers" if num_workers != 1 else f"{resources.gpus:g} GPUs per worker"
                 if resources.gpus > 0 else f"runtime_env {', '.join(unsupported)}")
        raise ValueError(f"worker group '{name}' cannot run in the driver's process: that takes one worker with no "
                         f"GPU and no runtime_env but env_vars; found {found}")


def rank_options(placement: Placement, rank: int, resources: WorkerResources) -> dict[str, Any]:
    """What rank ``rank``'s actor asks Ray for: its CPUs and GPUs (its share of its GPU, or
    none for a worker that spans several), its bundle, and its runtime environment."""
    return {
        "num_cpus": resources.cpus,
        "num_gpus": placement.actor_gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement.group, placement_group_bundle_index=placement.bundles[rank]
        ),
        "runtime_env": merged_runtime_env(resources),
    }


def rank_environments(placement: Placement) -> list[dict[str, str]]:
    """The variables each rank of ``placement`` sets before its worker starts: those of
    torch.distributed, and the bundles of a rank that spans several GPUs
    (:meth:`~posttrain.distributed.placement.Placement.device_env`)."""
    nodes = list(placement.nodes)
    master = nodes[0]
    if master == ray.get_runtime_context().get_node_id():
        port = free_port()
    else:
        strategy = PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=placement.bundles[0])
        port = ray.get(ray.remote(free_port).options(num_cpus=0, scheduling_strategy=strategy).remote())
    if len(set(nodes)) == 1:
        address = "127.0.0.1"
    else:
        address = next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == master)
    envs = []
    for rank, node in enumerate(nodes):
        envs.append(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(nodes)),
                "LOCAL_RANK": str(nodes[:rank].count(node)),
                "LOCAL_WORLD_SIZE": str(nodes.count(node)),
                "MASTER_ADDR": address,
                "MASTER_PORT": str(port),
                **placement.device_env(rank),
            }
        )
    return envs


def merged_runtime_env(resources: WorkerResources) -> dict[str, Any] | None:
    """``resources.runtime_env`` with ``resources.env_vars`` merged into its ``env_vars``."""
    runtime_env = dict(resources.runtime_env)
    if resources.env_vars:
        runtime_env["env_vars"] = {
            **runtime_env.get("env_vars", {}),
            **{k: str(v) for k, v in resources.env_vars.items()},
        }
    return runtime_env or None


def free_port() -> int:
    """A TCP port that is free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _actor_class(worker_cls: type[Worker]) -> type:
    """``worker_cls`` with a constructor that sets the rank variables and loads plugins
    before the worker's own ``__init__`` runs."""

    class Actor(worker_cls):  # type: ignore[valid-type, misc]
        def __init__(self, rank_env: dict[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]):
            os.environ.update(rank_env)
            plugin_host()
            super().__init__(*args, **kwargs)

    Actor.__name__ = Actor.__qualname__ = worker_cls.__name__
    return Actor


def _raised(error: BaseException) -> str:
    """``Type: message``, as the last line of a traceback names an exception (``module.Type``
    outside the builtins)."""
    kind = type(error)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}: {error}" if str(error) else name


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _one_line(text: str, limit: int = 600) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
