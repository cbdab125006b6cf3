"""The nodes of the Ray cluster this process is connected to: what each one has, how errors
name them, and waiting until the nodes a run needs have joined.

A node is named by its address, its host name and the start of its Ray node id
(``192.0.2.7 (host gpu-07, id 6c91964e0a22)``): on one machine several nodes share the
address, and the id tells them apart.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import ray

from posttrain.errors import ClusterError

#: Characters of a Ray node id (56 hex digits) that messages show.
ID_CHARS = 12
#: Seconds between two looks at the cluster while waiting for nodes.
POLL_S = 0.5


@attrs.frozen
class Node:
    """One Ray node as ``ray.nodes()`` reports it: ``resources`` are its totals (``CPU``,
    ``GPU``, ...)."""

    node_id: str
    address: str
    hostname: str
    alive: bool
    resources: dict[str, float]

    @classmethod
    def from_ray(cls, entry: dict[str, Any]) -> Node:
        return cls(
            node_id=entry["NodeID"],
            address=entry["NodeManagerAddress"],
            hostname=entry.get("NodeManagerHostname", ""),
            alive=bool(entry["Alive"]),
            resources={key: float(value) for key, value in entry.get("Resources", {}).items()},
        )

    @property
    def label(self) -> str:
        """How messages name the node: ``ADDRESS (host HOSTNAME, id 0123456789ab)``."""
        return f"{self.address} (host {self.hostname}, id {self.node_id[:ID_CHARS]})"

    def answers_to(self, name: str) -> bool:
        """Whether ``name`` is this node's address or host name (full, or both cut at their
        first dot: ``gpu-01`` answers to ``gpu-01.cluster.local``)."""
        if name in (self.hostname, self.address):
            return True
        return not _is_address(name) and not _is_address(self.hostname) and (
            name.split(".")[0] == self.hostname.split(".")[0]
        )

    def amounts(self, keys: Sequence[str] = ("CPU", "GPU")) -> str:
        """``2 CPU, 0 GPU``: the node's totals of ``keys``."""
        return ", ".join(f"{self.resources.get(key, 0.0):g} {key}" for key in keys)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def all_nodes() -> list[Node]:
    """Every node the cluster has known, dead ones included, in Ray's order."""
    return [Node.from_ray(entry) for entry in ray.nodes()]


def alive_nodes() -> list[Node]:
    """The nodes alive now."""
    return [node for node in all_nodes() if node.alive]


def node_dead(node_id: str) -> bool:
    """Whether the cluster has marked the node ``node_id`` dead (False while it is alive or
    unknown)."""
    return any(node.node_id == node_id and not node.alive for node in all_nodes())


def node_label(node_id: str) -> str:
    """:attr:`Node.label` of the node ``node_id`` (alive or not); the id alone if Ray does
    not know it."""
    for node in all_nodes():
        if node.node_id == node_id:
            return node.label
    return f"id {node_id[:ID_CHARS]}"


def per_node(nodes: Sequence[Node], keys: Sequence[str] = ("CPU", "GPU")) -> str:
    """``192.0.2.7 (host a, id ..): 2 CPU, 0 GPU; ...``: what each node has, for messages."""
    return "; ".join(f"{node.label}: {node.amounts(keys)}" for node in nodes) or "no node"


def cluster_address() -> str:
    """The address of the cluster's head (its GCS), as ``ray start --address`` takes it."""
    return str(ray.get_runtime_context().gcs_address)


def wait_for_nodes(
    *,
    count: int = 0,
    names: Sequence[str] = (),
    timeout_s: float,
    deadline: float | None = None,
    count_key: str = "",
    timeout_key: str = "",
    check: Callable[[], None] | None = None,
) -> list[Node]:
    """Wait until at least ``count`` nodes are alive and each of ``names`` (a host name or
    an address, :meth:`Node.answers_to`) is one of them; return the alive nodes.

    ``check`` is called between looks (e.g. to raise when the run is asked to stop). Past
    ``timeout_s`` seconds (or the ``time.monotonic()`` ``deadline`` when given, for a wait
    that began earlier) it raises :class:`ClusterError` naming the nodes that are missing
    and those that joined; ``count_key`` and ``timeout_key`` are the settings that asked for
    the count and the time (a config key or a command-line option), quoted in the message.
    """
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    while True:
        nodes = alive_nodes()
        missing = [name for name in names if not any(node.answers_to(name) for node in nodes)]
        if not missing and len(nodes) >= count:
            return nodes
        if time.monotonic() >= deadline:
            raise ClusterError(_missing_message(nodes, missing, count, timeout_s, count_key, timeout_key))
        if check is not None:
            check()
        time.sleep(POLL_S)


def _missing_message(
    nodes: list[Node], missing: list[str], count: int, timeout_s: float, count_key: str, timeout_key: str
) -> str:
    address = cluster_address()
    if missing:
        what = f"node(s) {', '.join(missing)} did not join the Ray cluster at {address}"
    elif count_key:
        what = f"{count_key}={count}, but the Ray cluster at {address} has {len(nodes)} alive node(s)"
    else:
        what = f"{count - len(nodes)} of {count} node(s) did not join the Ray cluster at {address}"
    after = f"after {timeout_s:g} s" + (f" ({timeout_key})" if timeout_key else "")
    fix = f"Start Ray on the missing nodes (ray start --address={address}) and check their Ray logs"
    if count_key and not missing:
        fix += f", or lower {count_key}"
    return f"{what} {after}. Alive: {per_node(nodes)}. {fix}."
