"""Starting TransferQueue in the current Ray cluster, or attaching to the running one.

TransferQueue keeps one named controller actor per Ray cluster plus its storage actors. The
process that starts them owns them: Ray kills them when that process exits, crashed or not,
so a crashed run leaves no queue behind. Any other process (a second plane, a Ray worker)
attaches to the running controller. Starting never hangs silently: it is bounded by
``init_timeout_s`` and fails naming what it asked Ray for and what Ray has. Nor does a call
wait on a dead actor: TransferQueue's client would wait forever on a controller or storage
unit that died (:func:`watch_actors`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any

import psutil
import ray

from posttrain.errors import ConfigError, ProcessDied, WorkerError
from posttrain_transferqueue.config import SECTION, TransferQueueConfig, check

# TransferQueue's own names (transfer_queue/interface.py and its SimpleStorage bootstrap).
CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{rank}"
#: Seconds a TransferQueue call runs before :func:`watch_actors` checks the queue's actors,
#: and again every as many seconds after.
WATCH_S = 2.0

# TransferQueue caps torch threads per call at this and warns on every put/get when it
# exceeds the physical cores; set it before transfer_queue is imported.
os.environ.setdefault("TQ_NUM_THREADS", str(max(1, min(8, psutil.cpu_count(logical=False) or 1))))


def actor_names(options: TransferQueueConfig) -> list[tuple[str, str | None]]:
    """TransferQueue's actors, as (name, Ray namespace): the controller, then each storage unit."""
    units = [(STORAGE_UNIT_NAME.format(rank=rank), None) for rank in range(options.num_storage_units)]
    return [(CONTROLLER_NAME, CONTROLLER_NAMESPACE), *units]


def transferqueue_conf(options: TransferQueueConfig) -> dict[str, Any]:
    """The override of TransferQueue's default config that ``tq.init`` receives."""
    return {
        "backend": {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {
                "num_data_storage_units": options.num_storage_units,
                "total_storage_size": options.storage_capacity,
            },
        }
    }


def controller_running() -> bool:
    """Whether a TransferQueue controller is alive in the connected Ray cluster."""
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return False
    return True


def connect(options: TransferQueueConfig, joined: str | None = None) -> bool:
    """Attach this process to TransferQueue, starting it when no controller runs.

    Ray must already be initialised. Returns True when this call started TransferQueue
    (this process then owns its actors; :func:`stop` ends them). Raises
    :class:`ConfigError` when the cluster can never hold the actors and
    :class:`WorkerError` when starting or attaching takes longer than
    ``options.init_timeout_s``. ``joined``: the address of the Ray cluster the run joined
    (None: the run started Ray), for what the errors suggest.
    """
    import transfer_queue as tq
    from transfer_queue import interface as tq_state

    if not ray.is_initialized():
        raise WorkerError("the transferqueue data plane needs Ray: call posttrain.distributed.init_ray first")
    _forget_dead_controller()
    # ``tq.init`` starts the storage units in the process that creates the controller and
    # keeps their handles in this module global (TransferQueue's own test of ownership).
    owned_before = tq_state._TQ_STORAGE is not None
    starting = not controller_running()
    if starting:
        _check_cluster_can_hold(options, joined)
    failure: list[BaseException] = []

    def init() -> None:
        try:
            tq.init(transferqueue_conf(options))
        except BaseException as error:  # reported to the caller below
            failure.append(error)

    thread = threading.Thread(target=init, name="posttrain-transferqueue-init", daemon=True)
    thread.start()
    thread.join(options.init_timeout_s)
    if thread.is_alive():
        message = _timeout_message(options, starting, joined)
        if starting:
            _abandon_start(options, thread)
        raise WorkerError(message)
    if failure:
        if starting:
            _abandon_start(options, thread)
        raise WorkerError(f"TransferQueue failed to {'start' if starting else 'attach'}: {failure[0]}") from failure[0]
    return not owned_before and tq_state._TQ_STORAGE is not None


def stop() -> None:
    """End TransferQueue: its controller, its storage units and every sample in them.
    Only the process that started it should call this."""
    import transfer_queue as tq

    tq.close()


def _more_cpus(joined: str | None) -> str:
    """How to get more Ray CPUs: ``cluster.num_cpus`` sizes only a cluster the run starts."""
    if joined is None:
        return "start Ray with more logical CPUs (cluster.num_cpus)"
    return f"add nodes with more CPUs to the Ray cluster at {joined} (cluster.num_cpus only sizes a cluster the run starts itself)"


def _check_cluster_can_hold(options: TransferQueueConfig, joined: str | None) -> None:
    check(options)
    total = ray.cluster_resources().get("CPU", 0.0)
    if options.cpus_needed > total + 1e-9:
        raise ConfigError(
            f"TransferQueue needs {options.cpus_needed} Ray CPUs (1 controller + {SECTION}.num_storage_units="
            f"{options.num_storage_units} storage units, 1 CPU each), but the whole Ray cluster has {total:g}. "
            f"Lower {SECTION}.num_storage_units or {_more_cpus(joined)}."
        )


def _timeout_message(options: TransferQueueConfig, starting: bool, joined: str | None) -> str:
    waited = f"within {options.init_timeout_s:g} s ({SECTION}.init_timeout_s)"
    if not starting:
        return (
            f"could not attach to the running TransferQueue controller {waited}: it has not finished starting. "
            "Check the process that started it."
        )
    resources = ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)
    return (
        f"TransferQueue did not start {waited}. It asked Ray for {options.cpus_needed} CPUs (1 controller + "
        f"{options.num_storage_units} storage units, 1 CPU each); the Ray cluster has {resources[0]:g} CPUs, "
        f"{resources[1]:g} free now. Free CPUs held by other worker groups or tasks, lower "
        f"{SECTION}.num_storage_units, or {_more_cpus(joined)}."
    )


def _abandon_start(options: TransferQueueConfig, init_thread: threading.Thread) -> None:
    """Kill the half-started actors (so a blocked ``tq.init`` fails and returns), then drop
    what the attempt left in this process: nothing of it survives."""
    import transfer_queue as tq

    for name, namespace in actor_names(options):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:
            pass  # never created
    init_thread.join(timeout=30)
    tq.close()


def _forget_dead_controller() -> None:
    """Drop this process's client of a controller that has died (its owner crashed), so
    the next ``tq.init`` starts or finds a live one instead of calling the dead one."""
    import transfer_queue as tq
    from transfer_queue import interface as tq_state

    if tq_state._TQ_CONTROLLER is None:
        return
    try:
        ray.get(tq_state._TQ_CONTROLLER.get_config.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        tq.close()


def watch_actors(client: Any, options: TransferQueueConfig) -> None:
    """Make every call of TransferQueue's ``client`` raise a :class:`ProcessDied` when the
    controller or a storage unit dies under it. A call that has run :data:`WATCH_S` seconds
    checks the actors, and again every :data:`WATCH_S` seconds until it returns. A run with
    ``checkpointing.max_restarts`` then restarts."""
    loop = client._loop

    def run_coroutine(coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        while True:
            try:
                return future.result(timeout=WATCH_S)
            except concurrent.futures.TimeoutError:
                dead = _dead_actor(options)
                if dead is not None:
                    future.cancel()
                    name, death = dead
                    raise ProcessDied(
                        f"TransferQueue's {name} actor died during a data-plane call: the samples it held are lost. "
                        "The run restarts from its last checkpoint when checkpointing.max_restarts allows"
                    ) from death

    client._run_coroutine = run_coroutine  # TransferQueue's sync methods all call it


def _dead_actor(options: TransferQueueConfig) -> tuple[str, ray.exceptions.RayActorError] | None:
    """The first of TransferQueue's actors found dead, with Ray's error; None when all answer
    (or are too busy to answer within a second: not dead)."""
    from transfer_queue import interface as tq_state

    for name, namespace in actor_names(options):
        handle = tq_state._TQ_CONTROLLER if name == CONTROLLER_NAME and tq_state._TQ_CONTROLLER else None
        try:
            handle = handle or ray.get_actor(name, namespace=namespace)
            ping = handle.__ray_ready__.remote()
            if ray.wait([ping], timeout=1.0)[0]:
                ray.get(ping)
        except ValueError:  # its name is gone from the cluster: it died
            return name, ray.exceptions.ActorDiedError()
        except ray.exceptions.RayActorError as death:
            return name, death
    return None
