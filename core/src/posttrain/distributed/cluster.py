"""Starting or joining Ray, and reserving resources for worker groups.

:func:`init_ray` connects this process to Ray once. :class:`VirtualCluster` waits for the
nodes the run needs (``cluster.num_nodes``) and reserves one placement group per worker
group, packed onto as few nodes as possible: one bundle per GPU for a group that asks for
GPUs, else one per ``ranks_per_bundle`` workers that must share a node; the ranks ordered by
node (:mod:`posttrain.distributed.placement`). Two groups that share devices ("colocated")
each ask for a fraction of a GPU (e.g. ``gpus=0.5``): the second goes on the first one's
bundles, each of its workers on the GPU of the rank it shares with. A colocated group
without GPUs goes to the nodes of the group it follows. Logical CPUs may exceed physical
cores.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from posttrain.config.schema import ClusterConfig, RunConfig, WorkerResources
from posttrain.distributed.nodes import Node, alive_nodes, cluster_address, per_node, wait_for_nodes
from posttrain.distributed.placement import Layout, Placement, Shape, follow_nodes, layout, pinned, placed
from posttrain.distributed.ray_output import show_forwarded_output
from posttrain.errors import ConfigError, WorkerError
from posttrain.gc_thresholds import collect_less_often
from posttrain.log import library_env, library_log_level

#: The variable through which every worker of the job learns the driver's working directory.
DRIVER_CWD_VAR = "POSTTRAIN_DRIVER_CWD"
#: Seconds between two looks for the placement of the group a colocated group follows.
FOLLOW_POLL_S = 0.05
#: Ray's switch that hides every GPU from a task or actor that asks for none
#: (``CUDA_VISIBLE_DEVICES=""``); without it, Ray 2.60 leaves them all visible to such a process.
HIDE_UNASKED_GPUS_VAR = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
#: Ray's settings for a local cluster a run starts. Ray starts one idle worker process per
#: logical CPU (up to the cores) as the driver connects, ahead of any task or actor. A run's
#: actors start in processes of their own runtime environment (their ``resources.env_vars``),
#: and a one-box run by default has none, so those processes only sat idle: about 80 MB and
#: half a CPU-second each. Without them an actor's process starts when it is created.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def init_ray(config: ClusterConfig) -> bool:
    """Connect to Ray unless already connected; return whether this call started a local
    cluster (False when it joined one, or was connected already).

    Joins ``config.ray_address`` or ``$RAY_ADDRESS`` when either is set; otherwise starts
    a local cluster with ``config.num_cpus`` logical CPUs (all cores when None), no
    dashboard, and no idle worker processes started ahead of need (:data:`LOCAL_SYSTEM_CONFIG`).
    ``RAY_AUTH_MODE`` defaults to ``disabled`` (no token file is written).

    Every worker process of the job starts in this process's working directory when that
    directory exists on its node (:func:`enter_driver_directory`), so relative paths in a
    config mean the same on every node as in the driver, and collects garbage less often
    (:mod:`posttrain.gc_thresholds`), which makes its start faster (:func:`setup_worker_process`).

    ``ray.init`` replaces the SIGTERM handler with one that exits at once; a handler the
    program installed before (a run's graceful stop, :mod:`posttrain.run.stop`) is put back.
    Ray's auto-connect is turned off (:func:`_no_auto_connect`). Call it on the main thread:
    Ray ties the processes of a cluster it starts to the thread that started it (they die
    when that thread ends).

    Every task and actor of the job that asks Ray for no GPU sees none
    (:data:`HIDE_UNASKED_GPUS_VAR`), so a worker computes on CUDA only where its group asked
    for GPUs.

    Logging follows the configured ``logger.level`` (:mod:`posttrain.log`): Ray's own logger
    gets :func:`~posttrain.log.library_log_level`, this job's workers the environment of
    :func:`~posttrain.log.library_env`, and what Ray forwards to this process is shown as
    :mod:`posttrain.distributed.ray_output` says.
    """
    if ray.is_initialized():
        return False
    _no_auto_connect()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    address = joined_address(config)
    runtime_env = {
        "env_vars": {**library_env(), DRIVER_CWD_VAR: os.getcwd(), HIDE_UNASKED_GPUS_VAR: "1"},
        "worker_process_setup_hook": f"{__name__}.{setup_worker_process.__name__}",
    }
    options: dict[str, Any] = {"logging_level": library_log_level(), "runtime_env": runtime_env}
    if address:
        ray.init(address=address, **options)
    else:
        ray.init(
            address="local",
            num_cpus=config.num_cpus if config.num_cpus is not None else os.cpu_count(),
            num_gpus=config.num_gpus,
            include_dashboard=False,
            _system_config=LOCAL_SYSTEM_CONFIG,
            **options,
        )
    show_forwarded_output()
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)
    return not address


def joined_address(config: ClusterConfig) -> str | None:
    """The address of the running cluster the config joins (``cluster.ray_address``, else
    ``$RAY_ADDRESS``); None when the run starts a local one."""
    return config.ray_address or os.environ.get("RAY_ADDRESS") or None


def check_node_count(config: ClusterConfig) -> None:
    """Refuse ``cluster.num_nodes`` below 1, or above 1 for a run that would start its own
    (one-node) Ray: call it before Ray starts."""
    if config.num_nodes < 1:
        raise ConfigError(f"cluster.num_nodes must be at least 1, found {config.num_nodes}")
    if config.num_nodes > 1 and not ray.is_initialized() and not joined_address(config):
        raise ConfigError(
            f"cluster.num_nodes={config.num_nodes}, but neither cluster.ray_address nor RAY_ADDRESS names a "
            "Ray cluster to join, and the local cluster a run starts has one node. Start Ray on every node, "
            "then set RAY_ADDRESS (or cluster.ray_address) to the head's address (see docs/clusters.md), or "
            "set cluster.num_nodes=1."
        )


def setup_worker_process() -> None:
    """Ray's worker-process setup hook of posttrain's jobs (it runs before the process imports
    its actor's class): :func:`~posttrain.gc_thresholds.collect_less_often`, then
    :func:`enter_driver_directory`."""
    collect_less_often()
    enter_driver_directory()


def enter_driver_directory() -> None:
    """Change into the driver's working directory (``$POSTTRAIN_DRIVER_CWD``) when this node
    has it, unless the worker's runtime environment has a ``working_dir`` of its own. Without
    it a worker runs in the directory where Ray was started on its node, and a relative path
    means something else there than in the driver."""
    folder = os.environ.get(DRIVER_CWD_VAR)
    in_working_dir = "runtime_resources" in Path.cwd().parts  # where Ray unpacks a runtime_env working_dir
    if folder and Path(folder).is_dir() and not in_working_dir:
        os.chdir(folder)


def _no_auto_connect() -> None:
    """Turn off Ray's auto-connect in this process: a Ray call after ``ray.shutdown`` raises
    instead of starting a new local cluster. posttrain starts and stops Ray itself, on the
    main thread; after a run stopped during its start-up, a thread still starting its workers
    (:mod:`posttrain.run.startup`) would otherwise start a second cluster from its clean-up
    calls, one that dies with that thread (Ray's ``auto_init_hook`` reads its switch once, at
    import)."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The Ray node id of each bundle of ``group``, in bundle order."""
    node_of = placement_group_table(group)["bundles_to_node_id"]
    return [node_of[index] for index in range(group.bundle_count)]


def bundle_of(resources: WorkerResources) -> dict[str, float]:
    """What one worker with these resources asks Ray for."""
    bundle = {"CPU": float(resources.cpus), "GPU": float(resources.gpus)}
    bundle = {key: value for key, value in bundle.items() if value > 0}
    if not bundle:
        raise ConfigError(
            f"worker resources {{cpus: {resources.cpus}, gpus: {resources.gpus}}} ask for nothing; "
            "set resources.cpus or resources.gpus above 0"
        )
    return bundle


@attrs.frozen
class Colocated:
    """A worker group that shares the devices of group ``host`` and takes turns with it.
    ``shape`` is what it will ask for; when both groups ask for GPUs, the host's bundles hold
    the two (:func:`~posttrain.distributed.placement.layout`), so it must be known before the
    host is placed."""

    host: str
    shape: Shape | None = None


def colocated_groups(config: RunConfig) -> dict[str, Colocated]:
    """The run's colocated groups: with ``generation.colocated`` (engines of their own), the
    ``generation`` group shares the ``policy``'s devices, its shape from the config (an
    engine spans ``generation.tensor_parallel_size`` GPUs when it asks for GPUs)."""
    gen = config.generation
    if not gen.colocated or gen.in_policy_workers:
        return {}
    devices = gen.tensor_parallel_size if gen.resources.gpus > 0 else 1
    return {"generation": Colocated("policy", Shape(gen.num_workers, gen.resources.cpus, gen.resources.gpus,
                                                    devices_per_worker=devices))}


class VirtualCluster:
    """The resources of a run, handed out to worker groups as placement groups.

    Creating it connects to Ray (:func:`init_ray`), then waits up to ``cluster.node_wait_s``
    until ``cluster.num_nodes`` nodes are alive (``check`` is called while it waits, e.g. to
    stop on a signal); a run that starts its own (one-node) Ray cannot ask for more.
    ``placement_timeout_s`` bounds the wait for a placement group: past it,
    :meth:`reserve` raises instead of hanging. ``colocate`` maps a worker group's name to
    the group it shares devices with (a name, or a :class:`Colocated`): when both ask for
    GPUs, it is placed on that group's bundles, each of its workers on the GPU(s) of the
    ranks it shares with (its :attr:`Colocated.shape` declared); otherwise, on a cluster of
    several nodes, its workers go to that group's nodes
    (:func:`~posttrain.distributed.placement.follow_nodes`). Either way it waits for that
    group's placement. ``started_ray``: whether the caller connected this process by starting
    a local cluster (None: the cluster connects it, :func:`init_ray`).
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        placement_timeout_s: float = 120.0,
        colocate: Mapping[str, str | Colocated] | None = None,
        check: Callable[[], None] | None = None,
        started_ray: bool | None = None,
    ):
        self.config = config
        self.placement_timeout_s = placement_timeout_s
        self.colocate = {name: c if isinstance(c, Colocated) else Colocated(c) for name, c in (colocate or {}).items()}
        check_node_count(config)
        #: Whether the run started Ray itself (a local, one-node cluster sized by the config).
        self.started_ray = init_ray(config) if started_ray is None else started_ray
        #: The nodes alive once the run's nodes had joined.
        self.nodes: list[Node] = wait_for_nodes(
            count=config.num_nodes, timeout_s=config.node_wait_s, count_key="cluster.num_nodes",
            timeout_key="cluster.node_wait_s", check=check,
        )
        self._placements: dict[str, Placement] = {}
        self._guests: dict[str, tuple[Shape, Placement]] = {}  # guest name -> its declared shape, placed with its host
        self._lock = threading.Lock()  # worker groups may start from several threads at once
        self._placing = threading.Lock()  # one placement group is placed at a time (see _place)
        self._closed = False

    def reserve(
        self, name: str, num_workers: int, resources: WorkerResources, *, ranks_per_bundle: int = 1,
        devices_per_worker: int = 1,
    ) -> Placement:
        """Reserve bundles for the ``num_workers`` workers of group ``name`` and wait for them.

        ``ranks_per_bundle`` consecutive ranks (a tensor-parallel group) share a node; each
        worker spans ``devices_per_worker`` GPUs when it asks for GPUs (``resources.gpus``
        over them: an engine with tensor-parallel workers of its own). Bundles and ranks
        follow :mod:`posttrain.distributed.placement`.
        Raises :class:`ConfigError` when the cluster can never hold the request (in all, or
        what must share a node on any single node; the message lists what each node has) and
        :class:`WorkerError` when it is not placed within the timeout (resources held by
        other groups or tasks), or when the cluster was shut down meanwhile (a run stopped
        during its start-up: the group is not placed).
        """
        if self._closed:
            raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")
        if name in self._placements:
            raise WorkerError(f"worker group '{name}' already holds a placement group; shut it down first")
        if num_workers < 1:
            raise ConfigError(f"worker group '{name}': num_workers must be at least 1, got {num_workers}")
        if ranks_per_bundle < 1 or num_workers % ranks_per_bundle:
            raise ConfigError(
                f"worker group '{name}': {num_workers} workers do not split into groups of {ranks_per_bundle} "
                "that share a node; make num_workers a multiple of it"
            )
        one = bundle_of(resources)
        shape = Shape(num_workers, resources.cpus, resources.gpus, ranks_per_bundle,
                      devices_per_worker if resources.gpus > 0 else 1)
        if (shared := self._shared_with_host(name, shape)) is not None:
            return shared
        guest_name, guest = self._guest_of(name, shape)
        plan = layout(shape, guest)
        asked = f"worker group '{name}' asked for {num_workers} x {one}"
        together = max(len(group) for group in plan.node_groups)
        if not shape.on_gpus and ranks_per_bundle > 1:
            asked += f" ({ranks_per_bundle} workers on one node: {len(plan.bundles)} x {plan.bundles[0]})"
        if guest is not None:
            asked += f" and shares its GPUs with '{guest_name}' ({guest.num_workers} x {guest.gpus:g} GPU)"
        if shape.on_gpus and together > 1:
            asked += f" ({together:g} GPUs on one node)"
        self._check_fits(asked, plan)
        selectors = self._follow(name, len(plan.bundles))
        pinned_to = f" (pinned to the nodes of '{self.colocate[name].host}', colocated)" if selectors else ""
        group, nodes, renumber = self._place(name, asked + pinned_to, plan, selectors)
        workers = [tuple(renumber[b] for b in worker) for worker in plan.workers]
        placement = placed(group, nodes, workers, on_gpus=shape.on_gpus, gpus_per_device=plan.gpus_per_device)
        with self._lock:
            if not self._closed:
                self._placements[name] = placement
                if guest is not None:
                    guest_workers = [tuple(renumber[b] for b in worker) for worker in plan.guest_workers]
                    self._guests[guest_name] = (guest, placed(group, nodes, guest_workers, on_gpus=True,
                                                              gpus_per_device=plan.guest_gpus_per_device))
                return placement
        remove_placement_group(group)
        raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")

    def release(self, name: str) -> None:
        """Let group ``name`` go; its placement group is removed once no group holds it
        (a colocated guest holds its host's). No-op if it holds none."""
        with self._lock:
            placement = self._placements.pop(name, None)
            for guest, colocated in self.colocate.items():
                if colocated.host == name:
                    self._guests.pop(guest, None)
            held = placement is not None and any(p.group.id == placement.group.id for p in self._placements.values())
        if placement is not None and not held:
            remove_placement_group(placement.group)

    def placement_groups(self) -> dict[str, PlacementGroup]:
        """The placement groups currently held, by worker group name."""
        return {name: placement.group for name, placement in self._placements.items()}

    def placements(self) -> dict[str, Placement]:
        """The placements currently held, by worker group name."""
        return dict(self._placements)

    def shutdown(self) -> None:
        """Remove every placement group this cluster reserved; no group is placed after it.
        Ray itself keeps running."""
        self._closed = True
        for name in list(self._placements):
            self.release(name)

    def _guest_of(self, name: str, shape: Shape) -> tuple[str, Shape | None]:
        """The colocated group that goes on the bundles of group ``name`` (both ask for
        GPUs), with its declared shape; ``("", None)`` when none does."""
        guests = [(guest, c.shape) for guest, c in self.colocate.items() if c.host == name]
        sharing = [(guest, s) for guest, s in guests if s is not None and s.on_gpus and shape.on_gpus]
        if len(sharing) > 1:
            raise WorkerError(f"worker group '{name}' shares its GPUs with {[g for g, _ in sharing]}; one group at most")
        return sharing[0] if sharing else ("", None)

    def _shared_with_host(self, name: str, shape: Shape) -> Placement | None:
        """The placement of a colocated group on its host's bundles (placed with the host),
        once the host is placed; None when the group has a placement group of its own."""
        colocated = self.colocate.get(name)
        if colocated is None or not shape.on_gpus:
            return None
        host = self._wait_for_host(name, colocated.host)
        if not host.devices:
            return None  # the host has no GPUs to share: this group's own, on the host's nodes
        if name not in self._guests:
            raise WorkerError(
                f"worker group '{name}' is colocated with '{colocated.host}' and both ask for GPUs, but its shape was "
                f"not declared when '{colocated.host}' was placed: pass VirtualCluster(colocate={{'{name}': "
                f"Colocated('{colocated.host}', Shape(...))}})"
            )
        declared, placement = self._guests[name]
        if declared != shape:
            raise WorkerError(f"worker group '{name}' asked for {shape}, but {declared} was declared when "
                              f"'{colocated.host}' was placed on the GPUs it shares")
        with self._lock:
            if self._closed:
                raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")
            self._placements[name] = placement
        return placement

    def _wait_for_host(self, name: str, host: str) -> Placement:
        """The placement of group ``host``, which group ``name`` is colocated with, once placed."""
        deadline = time.monotonic() + self.placement_timeout_s
        while (placement := self._placements.get(host)) is None:
            if self._closed:
                raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"worker group '{name}' is colocated with '{host}' and goes to the nodes of its workers, but "
                    f"'{host}' was not placed within {self.placement_timeout_s:g} s. Start '{host}' before or "
                    f"together with '{name}', or do not colocate them."
                )
            time.sleep(FOLLOW_POLL_S)
        return placement

    def _place(self, name: str, asked: str, plan: Layout, selectors: list[dict[str, str]] | None,
               ) -> tuple[PlacementGroup, list[str], list[int]]:
        """Create and wait for the placement group of ``plan``: ``(group, node of each bundle,
        the new index of each of the plan's bundles)``.

        A group with GPUs on a cluster of several nodes is placed twice: first one bundle per
        node group (Ray places a bundle on a single node), read and removed, its nodes handed
        out again in order (:func:`in_order`); then the group proper, its node groups in the
        order of their nodes, each bundle pinned to its node group's node. So what must share
        a node does, and ranks and bundles come in the same order (a colocated group's
        workers on the GPUs of the ranks the layout meant). Groups are placed one at a time,
        so that no other group of the run takes what the first placement found between the
        two."""
        bundles, renumber = list(plan.bundles), list(range(len(plan.bundles)))
        with self._placing:
            if selectors is None and plan.gpus_per_device > 0 and len(alive_nodes()) > 1:
                sums = [_sum(plan.bundles[b] for b in group) for group in plan.node_groups]
                probe = self._placed(name, asked, sums, None, suffix="-nodes")
                where = in_order(bundle_nodes(probe), sums)
                remove_placement_group(probe)
                order = sorted(range(len(sums)), key=lambda g: (where.index(where[g]), g))
                sequence = [b for g in order for b in plan.node_groups[g]]
                bundles = [plan.bundles[b] for b in sequence]
                renumber = [sequence.index(b) for b in range(len(sequence))]
                node_of = {b: where[g] for g, group in enumerate(plan.node_groups) for b in group}
                selectors = [pinned(node_of[b]) for b in sequence]
            group = self._placed(name, asked, bundles, selectors)
        return group, bundle_nodes(group), renumber

    def _placed(self, name: str, asked: str, bundles: list[dict[str, float]],
                selectors: list[dict[str, str]] | None, suffix: str = "") -> PlacementGroup:
        """A placement group of ``bundles`` (packed, each pinned by its label selector), once
        Ray placed it; raises :class:`WorkerError` past the timeout."""
        group = placement_group([dict(b) for b in bundles], strategy="PACK", name=f"posttrain-{name}{suffix}",
                                bundle_label_selector=selectors)
        ready, _ = ray.wait([group.ready()], timeout=self.placement_timeout_s)
        if ready:
            return group
        remove_placement_group(group)
        raise WorkerError(
            f"{asked} and was not placed within {self.placement_timeout_s:g} s. Cluster total: "
            f"{_brief(ray.cluster_resources())}; available now: {_brief(ray.available_resources())}"
            f"{self._per_node_text()}. Other worker groups or tasks hold the rest: shut them down, lower the "
            "request, or give Ray more logical CPUs."
        )

    def _check_fits(self, asked: str, plan: Layout) -> None:
        """Raise :class:`ConfigError` when the plan's bundles exceed the whole cluster or
        what must share a node exceeds every node."""
        total = ray.cluster_resources()
        nodes = alive_nodes()
        together = [_sum(plan.bundles[b] for b in group) for group in plan.node_groups]
        for key, value in _sum(plan.bundles).items():
            if value > total.get(key, 0.0) + 1e-9:
                raise ConfigError(
                    f"{asked} = {value:g} {key} in all, but the whole Ray cluster has "
                    f"{total.get(key, 0.0):g} {key}. {self._more(key, nodes)}"
                )
            need = max(group.get(key, 0.0) for group in together)
            largest = max((node.resources.get(key, 0.0) for node in nodes), default=0.0)
            if need > largest + 1e-9:
                raise ConfigError(
                    f"{asked}, {need:g} {key} on one node, but the largest node has {largest:g} {key}. "
                    f"{self._more(key, nodes)}"
                )

    def _more(self, key: str, nodes: list[Node]) -> str:
        """How to get past a shortage of ``key``, for the cluster at hand."""
        field = _field(key)
        if self.started_ray:
            return f"Lower num_workers or resources.{field}, or start Ray with more (cluster.num_{field})."
        return (
            f"The Ray cluster at {cluster_address()} has, per node: {per_node(nodes)}. Lower num_workers or "
            f"resources.{field}, or add nodes with more {key} to the cluster (cluster.num_{field} only sizes "
            "a cluster the run starts itself)."
        )

    def _per_node_text(self) -> str:
        nodes = alive_nodes()
        return f"; per node: {per_node(nodes)}" if len(nodes) > 1 else ""

    def _follow(self, name: str, count: int) -> list[dict[str, str]] | None:
        """The bundle label selectors that put group ``name`` on the nodes of the group it is
        colocated with (and does not share GPUs with); None when it follows none or the
        cluster has one node."""
        colocated = self.colocate.get(name)
        if colocated is None or len(alive_nodes()) < 2:
            return None
        return follow_nodes(self._wait_for_host(name, colocated.host).nodes, count)


def in_order(nodes: list[str], needs: list[dict[str, float]]) -> list[str]:
    """The nodes Ray chose for ``needs`` (``nodes[i]`` for ``needs[i]``), handed out again in
    order: the first node (by first appearance) to the first needs, as many as the GPUs Ray
    found there hold, then the next node; so that consecutive needs share a node as far as
    they can. ``nodes`` unchanged when needs of different GPU counts do not fit that way.
    (CPUs are left to Ray's placement of the group proper: a colocated engine's CPUs make
    otherwise equal needs differ by a few, which a GPU node has to spare.)"""
    room: dict[str, float] = {}
    for node, need in zip(nodes, needs, strict=True):
        room[node] = room.get(node, 0.0) + need.get("GPU", 0.0)
    given: list[str] = []
    for node, gpus in room.items():
        while len(given) < len(needs) and needs[len(given)].get("GPU", 0.0) <= gpus + 1e-9:
            gpus -= needs[len(given)].get("GPU", 0.0)
            given.append(node)
    return given if len(given) == len(needs) else nodes


def _sum(bundles: Iterable[dict[str, float]]) -> dict[str, float]:
    """The resources of several bundles together."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _field(resource: str) -> str:
    return {"CPU": "cpus", "GPU": "gpus"}.get(resource, resource)


def _brief(resources: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in sorted(resources.items()) if key in ("CPU", "GPU")}
