"""Waiting until a Ray cluster's head answers and its nodes have joined (``posttrain launch
wait``, which the Slurm script runs before the run)."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from posttrain.errors import ClusterError

#: Seconds between two tries to reach the head.
RETRY_S = 1.0


def wait_for_cluster(address: str, *, names: Sequence[str] = (), count: int = 0, timeout_s: float) -> list[str]:
    """Wait, ``timeout_s`` seconds in all, until the Ray head at ``address`` (``host:port``)
    accepts connections, then until each of ``names`` (host names or addresses) has joined
    and at least ``max(count, len(names))`` nodes are alive; return the labels of the alive
    nodes.

    Raises :class:`ClusterError` naming the head that did not answer, or the nodes that did
    not join and those that did. A process not yet connected to Ray is connected for the
    wait only."""
    import ray

    from posttrain.config.schema import ClusterConfig
    from posttrain.distributed.cluster import init_ray
    from posttrain.distributed.nodes import wait_for_nodes

    deadline = time.monotonic() + timeout_s
    _wait_for_head(address, deadline, timeout_s)
    connected_before = ray.is_initialized()
    init_ray(ClusterConfig(ray_address=address))
    try:
        nodes = wait_for_nodes(
            count=max(count, len(names)), names=names, timeout_s=timeout_s, deadline=deadline,
            count_key="" if names else "--num-nodes", timeout_key="--timeout-s",
        )
        return [node.label for node in nodes]
    finally:
        if not connected_before:
            ray.shutdown()


def _wait_for_head(address: str, deadline: float, timeout_s: float) -> None:
    """Return once a TCP connection to ``address`` succeeds (``ray.init`` would block for
    minutes on a head that is not up yet)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"--address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379)")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=RETRY_S):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"the Ray head at {address} did not answer within {timeout_s:g} s (--timeout-s): {error}. "
                    "Check that `ray start --head` runs on that node (its output is in the job's log) and that "
                    "the port is open between the nodes."
                ) from None
            time.sleep(RETRY_S)
