"""Automatic restarts: a run whose worker, engine or node died starts again from its last
checkpoint, up to ``checkpointing.max_restarts`` times, without a person.

Only a process that died restarts a run (a worker group's rank that died, a node the
cluster lost, or a process a worker's call depended on: :class:`~posttrain.errors.WorkerError`
caused by Ray's actor-death error, :class:`~posttrain.errors.NodeLost`,
:class:`~posttrain.errors.ProcessDied`);
a method that raised, a config or data error, a diverged loss or a stop signal ends the run
as before, since a restart would meet it again. Between attempts the Ray this process started
is shut down, and the next attempt waits ``restart_backoff_s`` seconds, doubled after each
restart. Each restart logs one ``restarting`` event (to the terminal and ``events.jsonl``)
naming the failure, the checkpoint it resumes from and the attempt. The driver's own death
still needs the command again.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from posttrain.config.schema import RunConfig
from posttrain.errors import NodeLost, ProcessDied, WorkerError
from posttrain.log import get_logger


def run_with_restarts(config: RunConfig, run: Callable[[RunConfig], dict[str, Any]]) -> dict[str, Any]:
    """``run(config)``, started again after a process of the run died (module docstring)."""
    allowed = config.checkpointing.max_restarts if config.checkpointing.enabled else 0
    for restart in range(allowed + 1):
        connected_before = _ray_connected()
        try:
            return run(config)
        except WorkerError as failure:
            if restart == allowed or not died(failure):
                raise
            wait_s = config.checkpointing.restart_backoff_s * 2**restart
            get_logger().warning(
                "restarting", failure=str(failure).splitlines()[0], resumes_from=_latest(config) or "the start",
                restart=f"{restart + 1} of {allowed}", in_s=wait_s,
            )
        finally:
            if not connected_before and _ray_connected():  # this attempt started Ray: stop it
                sys.modules["ray"].shutdown()
        time.sleep(wait_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


def died(failure: WorkerError) -> bool:
    """Whether ``failure`` is a process of the run that died (a node lost, a rank whose
    actor died, or a process a worker's call depended on), not a method that raised."""
    if isinstance(failure, (NodeLost, ProcessDied)):
        return True
    from posttrain.distributed.worker_group import actor_died

    return actor_died(failure.__cause__)


def _latest(config: RunConfig) -> str | None:
    """The newest complete checkpoint of the run, or None."""
    from posttrain.run.checkpoint import checkpoint_dir, latest_checkpoint

    latest = latest_checkpoint(checkpoint_dir(config))
    return None if latest is None else str(latest)


def _ray_connected() -> bool:
    """Whether this process is connected to Ray (without importing it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
