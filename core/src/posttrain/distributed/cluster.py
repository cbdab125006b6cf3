"""Starting or joining Ray, and reserving resources for worker groups.

:func:`init_ray` connects this process to Ray once. :class:`VirtualCluster` reserves one
placement group per worker group: one bundle ``{"CPU": cpus, "GPU": gpus}`` per worker,
packed onto as few nodes as possible. Two groups that should share devices ("colocated")
each ask for a fraction (e.g. ``gpus=0.5``); logical CPUs may exceed physical cores.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.errors import ConfigError, WorkerError
from posttrain.log import above_progress_bars, library_env, library_log_level


def init_ray(config: ClusterConfig) -> None:
    """Connect to Ray unless already connected.

    Joins ``config.ray_address`` or ``$RAY_ADDRESS`` when either is set; otherwise starts
    a local cluster with ``config.num_cpus`` logical CPUs (all cores when None) and no
    dashboard. ``RAY_AUTH_MODE`` defaults to ``disabled`` (no token file is written).

    ``ray.init`` replaces the SIGTERM handler with one that exits at once; a handler the
    program installed before (a run's graceful stop, :mod:`posttrain.run.stop`) is put back.
    Ray's auto-connect is turned off (:func:`_no_auto_connect`). Call it on the main thread:
    Ray ties the processes of a cluster it starts to the thread that started it (they die
    when that thread ends).

    Logging follows the configured ``logger.level`` (:mod:`posttrain.log`): Ray's own logger
    gets :func:`~posttrain.log.library_log_level`, this job's workers the environment of
    :func:`~posttrain.log.library_env`, and the workers' lines this process prints go above
    the progress bar.
    """
    if ray.is_initialized():
        return
    _no_auto_connect()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    env_vars = library_env()
    logging_options: dict[str, Any] = {"logging_level": library_log_level()}
    if env_vars:
        logging_options["runtime_env"] = {"env_vars": env_vars}
    if address:
        ray.init(address=address, **logging_options)
    else:
        ray.init(
            address="local",
            num_cpus=config.num_cpus if config.num_cpus is not None else os.cpu_count(),
            num_gpus=config.num_gpus,
            include_dashboard=False,
            **logging_options,
        )
    _print_worker_lines_above_progress_bars()
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)


def _print_worker_lines_above_progress_bars() -> None:
    """Wrap the handler through which Ray prints the workers' output in this process (Ray
    names it ``ray_print_logs``; ray 2.60 keeps its handlers in a private dispatcher) so its
    lines go above the progress bar instead of into it. Nothing to wrap without
    ``log_to_driver``. The autoscaler's batches (a status report every few seconds, of
    which Ray prints only the rare events) pass as they are: clearing the bar for each
    would make it flicker."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    def wrap(print_lines: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        def print_above_bars(data: dict[str, Any]) -> None:
            if not data.get("lines") or data.get("pid") == "autoscaler":
                print_lines(data)
                return
            with above_progress_bars(sys.stderr if data.get("is_err") else sys.stdout):
                print_lines(data)

        return print_above_bars

    with dispatcher._lock:
        dispatcher.handlers = [
            (name, wrap(handler) if name == "ray_print_logs" else handler) for name, handler in dispatcher.handlers
        ]


def _no_auto_connect() -> None:
    """Turn off Ray's auto-connect in this process: a Ray call after ``ray.shutdown`` raises
    instead of starting a new local cluster. posttrain starts and stops Ray itself, on the
    main thread; after a run stopped during its start-up, a thread still starting its workers
    (:mod:`posttrain.run.startup`) would otherwise start a second cluster from its clean-up
    calls, one that dies with that thread (Ray's ``auto_init_hook`` reads its switch once, at
    import)."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


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

    Creating it connects to Ray (:func:`init_ray`). ``placement_timeout_s`` bounds the
    wait for a placement group: past it, :meth:`reserve` raises instead of hanging.
    """

    def __init__(self, config: ClusterConfig, *, placement_timeout_s: float = 120.0):
        self.config = config
        self.placement_timeout_s = placement_timeout_s
        init_ray(config)
        self._groups: dict[str, PlacementGroup] = {}
        self._lock = threading.Lock()  # worker groups may start from several threads at once
        self._closed = False

    def reserve(self, name: str, num_workers: int, resources: WorkerResources) -> PlacementGroup:
        """Reserve ``num_workers`` bundles for the worker group ``name`` and wait for them.

        Raises :class:`ConfigError` when the cluster can never hold the request and
        :class:`WorkerError` when it is not placed within the timeout (resources held by
        other groups or tasks), or when the cluster was shut down meanwhile (a run stopped
        during its start-up: the group is not placed).
        """
        if self._closed:
            raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")
        if name in self._groups:
            raise WorkerError(f"worker group '{name}' already holds a placement group; shut it down first")
        if num_workers < 1:
            raise ConfigError(f"worker group '{name}': num_workers must be at least 1, got {num_workers}")
        bundle = bundle_of(resources)
        asked = f"worker group '{name}' asked for {num_workers} x {bundle}"
        total = ray.cluster_resources()
        for key, value in bundle.items():
            if value * num_workers > total.get(key, 0.0) + 1e-9:
                raise ConfigError(
                    f"{asked} = {value * num_workers:g} {key} in all, but the whole Ray cluster has "
                    f"{total.get(key, 0.0):g} {key}. Lower num_workers or resources.{_field(key)}, or start "
                    f"Ray with more (cluster.num_{_field(key)})."
                )
        group = placement_group([dict(bundle) for _ in range(num_workers)], strategy="PACK", name=f"posttrain-{name}")
        ready, _ = ray.wait([group.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(group)
            raise WorkerError(
                f"{asked} and was not placed within {self.placement_timeout_s:g} s. Cluster total: "
                f"{_brief(total)}; available now: {_brief(ray.available_resources())}. Other worker groups or "
                "tasks hold the rest: shut them down, lower the request, or give Ray more logical CPUs."
            )
        with self._lock:
            if not self._closed:
                self._groups[name] = group
                return group
        remove_placement_group(group)
        raise WorkerError(f"worker group '{name}' cannot start: the run's cluster is shut down")

    def release(self, name: str) -> None:
        """Remove the placement group of worker group ``name`` (no-op if it holds none)."""
        with self._lock:
            group = self._groups.pop(name, None)
        if group is not None:
            remove_placement_group(group)

    def placement_groups(self) -> dict[str, PlacementGroup]:
        """The placement groups currently held, by worker group name."""
        return dict(self._groups)

    def shutdown(self) -> None:
        """Remove every placement group this cluster reserved; no group is placed after it.
        Ray itself keeps running."""
        self._closed = True
        for name in list(self._groups):
            self.release(name)


def _field(resource: str) -> str:
    return {"CPU": "cpus", "GPU": "gpus"}.get(resource, resource)


def _brief(resources: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in sorted(resources.items()) if key in ("CPU", "GPU")}
