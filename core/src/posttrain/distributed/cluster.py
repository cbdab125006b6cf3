"""Starting or joining Ray, and reserving resources for worker groups.

:func:`init_ray` connects this process to Ray once. :class:`VirtualCluster` waits for the
nodes the run needs (``cluster.num_nodes``) and reserves one placement group per worker
group: one bundle ``{"CPU": cpus, "GPU": gpus}`` per worker (or per ``ranks_per_bundle``
workers that must share a node), packed onto as few nodes as possible, the ranks ordered by
node (:mod:`posttrain.distributed.placement`). Two groups that should share devices
("colocated") each ask for a fraction (e.g. ``gpus=0.5``), and on a cluster of several
nodes a colocated group's workers go to the nodes of the group they follow. Logical CPUs
may exceed physical cores.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed.nodes import Node, alive_nodes, cluster_address, per_node, wait_for_nodes
from posttrain.distributed.placement import Placement, follow_nodes, rank_order
from posttrain.distributed.ray_output import show_forwarded_output
from posttrain.errors import ConfigError, WorkerError
from posttrain.log import library_env, library_log_level

#: The variable through which every worker of the job learns the driver's working directory.
DRIVER_CWD_VAR = "POSTTRAIN_DRIVER_CWD"
#: Seconds between two looks for the placement of the group a colocated group follows.
FOLLOW_POLL_S = 0.05


def init_ray(config: ClusterConfig) -> bool:
    """Connect to Ray unless already connected; return whether this call started a local
    cluster (False when it joined one, or was connected already).

    Joins ``config.ray_address`` or ``$RAY_ADDRESS`` when either is set; otherwise starts
    a local cluster with ``config.num_cpus`` logical CPUs (all cores when None) and no
    dashboard. ``RAY_AUTH_MODE`` defaults to ``disabled`` (no token file is written).

    Every worker process of the job starts in this process's working directory when that
    directory exists on its node (:func:`enter_driver_directory`), so relative paths in a
    config mean the same on every node as in the driver.

    ``ray.init`` replaces the SIGTERM handler with one that exits at once; a handler the
    program installed before (a run's graceful stop, :mod:`posttrain.run.stop`) is put back.
    Ray's auto-connect is turned off (:func:`_no_auto_connect`). Call it on the main thread:
    Ray ties the processes of a cluster it starts to the thread that started it (they die
    when that thread ends).

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
        "env_vars": {**library_env(), DRIVER_CWD_VAR: os.getcwd()},
        "worker_process_setup_hook": f"{__name__}.{enter_driver_directory.__name__}",
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


def enter_driver_directory() -> None:
    """Ray's worker-process setup hook of posttrain's jobs: change into the driver's working
    directory (``$POSTTRAIN_DRIVER_CWD``) when this node has it, unless the worker's runtime
    environment has a ``working_dir`` of its own. Without it a worker runs in the directory
    where Ray was started on its node, and a relative path means something else there than
    in the driver."""
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
    """The placement-group bundle one worker with these resources needs."""
    bundle = {"CPU": float(resources.cpus), "GPU": float(resources.gpus)}
    bundle = {key: value for key, value in bundle.items() if value > 0}
    if not bundle:
        raise ConfigError(
            f"worker resources {{cpus: {resources.cpus}, gpus: {resources.gpus}}} ask for nothing; "
            "set resources.cpus or resources.gpus above 0"
        )
    return bundle


class VirtualCluster:
    """The resources of a run, handed out to worker groups as placement groups.

    Creating it connects to Ray (:func:`init_ray`), then waits up to ``cluster.node_wait_s``
    until ``cluster.num_nodes`` nodes are alive (``check`` is called while it waits, e.g. to
    stop on a signal); a run that starts its own (one-node) Ray cannot ask for more.
    ``placement_timeout_s`` bounds the wait for a placement group: past it,
    :meth:`reserve` raises instead of hanging. ``colocate`` maps a worker group's name to
    the group it shares devices with: on a cluster of several nodes, its workers go to that
    group's nodes (:func:`~posttrain.distributed.placement.follow_nodes`), so it waits for
    that group's placement.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        placement_timeout_s: float = 120.0,
        colocate: Mapping[str, str] | None = None,
        check: Callable[[], None] | None = None,
    ):
        self.config = config
        self.placement_timeout_s = placement_timeout_s
        self.colocate = dict(colocate or {})
        check_node_count(config)
        #: Whether this cluster started Ray itself (a local, one-node cluster sized by the config).
        self.started_ray = init_ray(config)
        #: The nodes alive once the run's nodes had joined.
        self.nodes: list[Node] = wait_for_nodes(
            count=config.num_nodes, timeout_s=config.node_wait_s, count_key="cluster.num_nodes",
            timeout_key="cluster.node_wait_s", check=check,
        )
        self._placements: dict[str, Placement] = {}
        self._lock = threading.Lock()  # worker groups may start from several threads at once
        self._closed = False

    def reserve(
        self, name: str, num_workers: int, resources: WorkerResources, *, ranks_per_bundle: int = 1
    ) -> Placement:
        """Reserve bundles for the ``num_workers`` workers of group ``name`` and wait for them.

        Each bundle holds ``ranks_per_bundle`` workers (a tensor-parallel group), so those
        ranks share a node; ranks are ordered by node (:func:`~posttrain.distributed.placement.rank_order`).
        Raises :class:`ConfigError` when the cluster can never hold the request (in all, or
        one bundle on any single node; the message lists what each node has) and
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
        bundle = {key: value * ranks_per_bundle for key, value in one.items()}
        count = num_workers // ranks_per_bundle
        asked = f"worker group '{name}' asked for {num_workers} x {one}"
        if ranks_per_bundle > 1:
            asked += f" ({ranks_per_bundle} workers on one node: {count} x {bundle})"
        self._check_fits(asked, bundle, count)
        selectors = self._follow(name, count)
        group = placement_group(
            [dict(bundle) for _ in range(count)], strategy="PACK", name=f"posttrain-{name}",
            bundle_label_selector=selectors,
        )
        ready, _ = ray.wait([group.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(group)
            pinned = f" (pinned to the nodes of '{self.colocate[name]}', colocated)" if selectors else ""
            raise WorkerError(
                f"{asked}{pinned} and was not placed within {self.placement_timeout_s:g} s. Cluster total: "
                f"{_brief(ray.cluster_resources())}; available now: {_brief(ray.available_resources())}"
                f"{self._per_node_text()}. Other worker groups or tasks hold the rest: shut them down, lower the "
                "request, or give Ray more logical CPUs."
            )
        placement = Placement(group, *rank_order(bundle_nodes(group), ranks_per_bundle))
        with self._lock:
            if not self._closed:
                self._placements[name] = placement
                return placement
        remove_placement_group(group)
        raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")

    def release(self, name: str) -> None:
        """Remove the placement group of worker group ``name`` (no-op if it holds none)."""
        with self._lock:
            placement = self._placements.pop(name, None)
        if placement is not None:
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

    def _check_fits(self, asked: str, bundle: dict[str, float], count: int) -> None:
        """Raise :class:`ConfigError` when ``count`` bundles exceed the whole cluster or one
        bundle exceeds every node."""
        total = ray.cluster_resources()
        nodes = alive_nodes()
        for key, value in bundle.items():
            if value * count > total.get(key, 0.0) + 1e-9:
                raise ConfigError(
                    f"{asked} = {value * count:g} {key} in all, but the whole Ray cluster has "
                    f"{total.get(key, 0.0):g} {key}. {self._more(key, nodes)}"
                )
            largest = max((node.resources.get(key, 0.0) for node in nodes), default=0.0)
            if value > largest + 1e-9:
                raise ConfigError(
                    f"{asked}, {value:g} {key} on one node, but the largest node has {largest:g} {key}. "
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
        colocated with; None when it follows none or the cluster has one node."""
        leader = self.colocate.get(name)
        if leader is None or len(alive_nodes()) < 2:
            return None
        deadline = time.monotonic() + self.placement_timeout_s
        while (placement := self._placements.get(leader)) is None:
            if self._closed:
                raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"worker group '{name}' is colocated with '{leader}' and goes to the nodes of its workers, but "
                    f"'{leader}' was not placed within {self.placement_timeout_s:g} s. Start '{leader}' before or "
                    f"together with '{name}', or do not colocate them."
                )
            time.sleep(FOLLOW_POLL_S)
        return follow_nodes(placement.nodes, count)


def _field(resource: str) -> str:
    return {"CPU": "cpus", "GPU": "gpus"}.get(resource, resource)


def _brief(resources: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in sorted(resources.items()) if key in ("CPU", "GPU")}
