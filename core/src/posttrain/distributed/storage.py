"""The start-up check that every node of the cluster sees the run's folders.

Policy ranks write their checkpoint shards themselves, each on its own node, so a run on
several nodes needs its run directory on storage every node mounts at the same path. The
check (:func:`check_shared_storage`) proves it before any worker starts: the driver writes
a probe file into each folder; a task on every other node reads it and writes one of its
own; the driver reads those back. A node that cannot is named with the folder, the config
key that set it and what failed.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from posttrain.distributed.nodes import Node, alive_nodes
from posttrain.errors import ClusterError

#: Seconds the probe tasks of all nodes have to answer, in all.
PROBE_TIMEOUT_S = 120.0


def check_shared_storage(folders: Mapping[str, Path], *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Check that every alive node other than this process's own can write into and read
    from each folder of ``folders`` (config key -> folder; created here if missing; a
    relative path counts from this process's working directory). Nothing to check when
    this process's node is the only one.

    Raises :class:`ClusterError` naming the first node (:attr:`Node.label`) and folder that
    fail, with the reason (the probe file it could not read or write, or its node's error),
    or the nodes whose probe did not finish within ``timeout_s``.
    """
    here = ray.get_runtime_context().get_node_id()
    nodes = [node for node in alive_nodes() if node.node_id != here]
    if not nodes:
        return
    for key, folder in folders.items():
        _probe_folder(key, Path(folder).absolute(), nodes, timeout_s)


def _probe_folder(key: str, folder: Path, nodes: list[Node], timeout_s: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    probe = folder / f".posttrain-probe-{token[:8]}"
    probe.mkdir()
    try:
        (probe / "driver").write_text(token)
        task = ray.remote(_node_probe)
        refs = {
            task.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            ).remote(str(probe), token, node.node_id): node
            for node in nodes
        }
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            node = refs[ref]
            problem = ray.get(ref) or _read_back(probe, node)
            if problem:
                raise ClusterError(_message(node, key, folder, problem))
        if late:
            names = ", ".join(refs[ref].label for ref in late)
            raise ClusterError(
                f"the storage check of {key} ({folder}) did not finish within {timeout_s:g} s on node(s) {names}: "
                "a task of the run could not start there. Check that node's Ray logs and that posttrain is "
                "installed on it."
            )
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _read_back(probe: Path, node: Node) -> str:
    """What is wrong with the file ``node`` wrote, as this process sees it; "" if nothing."""
    path = probe / f"node-{node.node_id}"
    try:
        found = path.read_text()
    except OSError as error:
        return f"the file it wrote ({path.name}) is not visible here ({type(error).__name__}: {error})"
    return "" if found == node.node_id else f"the file it wrote ({path.name}) reads {found[:40]!r} here"


def _node_probe(probe: str, token: str, node_id: str) -> str:
    """On a node: read the driver's probe file and write this node's own; "" when both
    worked, else what failed."""
    folder = Path(probe)
    try:
        found = (folder / "driver").read_text()
    except OSError as error:
        return f"it cannot read the file the driver wrote there ({type(error).__name__}: {error})"
    if found != token:
        return f"the file the driver wrote there reads {found[:40]!r} on that node"
    try:
        (folder / f"node-{node_id}").write_text(node_id)
    except OSError as error:
        return f"it cannot write there ({type(error).__name__}: {error})"
    return ""


def _message(node: Node, key: str, folder: Path, problem: str) -> str:
    return (
        f"node {node.label} cannot use {key} ({folder}): {problem}. Every node must see the run's folders at "
        "the same path: put them on a file system that every node mounts there (see 'Shared storage' in "
        "docs/clusters.md), or leave that node out of the cluster."
    )
