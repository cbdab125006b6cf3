"""Ray nodes on this machine, started with ``ray start --block`` as a user would on each node
of a cluster, and stopped by their own process group: multi-node behaviour (placement over
nodes, a node lost mid-run) tested on one machine.

Each node gets a private Ray temp folder: ``ray start`` records the cluster's address in
``<temp>/ray_current_cluster``, which ``ray.init()`` without an address (in any process of
this machine, other test sessions included) would otherwise join. Every port the head opens
by default (client server, dashboard agent) is a free one instead, so nodes of parallel test
sessions do not collide. A node's processes are those ``ray start`` started: the raylet
gives the node's id, and stopping the node kills them all.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")
#: Ray's health check at test speed: a node whose raylet is gone is marked dead within ~2 s
#: (Ray's default takes ~15 s). Set in the head's environment (Ray reads RAY_<setting>).
FAST_HEALTH_CHECK = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_ip() -> str:
    """The address Ray registers this machine's nodes under."""
    from ray._private.services import get_node_ip_address

    return str(get_node_ip_address())


class LocalNode:
    """One ``ray start ... --block`` process (and the node's processes) started in ``cwd``
    with ``args`` after ``ray start``, logging to ``log``. ``wrapper`` runs before ``ray``
    (e.g. ``unshare`` for a node with a mount namespace of its own)."""

    def __init__(self, args: Sequence[str], *, temp_dir: Path, cwd: Path, log: Path, head: bool,
                 wrapper: Sequence[str] = (), env: dict[str, str] | None = None):
        self.temp_dir = temp_dir
        options = [f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats",
                   "--block"]
        if head:
            options += ["--include-dashboard=false", f"--ray-client-server-port={free_port()}"]
        environ = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
        environ.pop("RAY_ADDRESS", None)
        with open(log, "ab") as out:
            self.process = subprocess.Popen([*wrapper, RAY, "start", *args, *options], cwd=cwd, env=environ,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._node_id: str | None = None

    def node_id(self, timeout_s: float = 120.0) -> str:
        """The node's Ray id, read from its raylet's command line (waits for the raylet)."""
        deadline = time.monotonic() + timeout_s
        while self._node_id is None:
            for proc in self.processes():
                try:
                    words = proc.cmdline()
                except psutil.Error:
                    continue
                if words and Path(words[0]).name == "raylet":
                    self._node_id = next(w.split("=", 1)[1] for w in words if w.startswith("--node_id="))
            assert self.process.poll() is None, f"ray start exited with {self.process.returncode}"
            assert time.monotonic() < deadline, "the node's raylet did not start"
            time.sleep(0.2)
        return self._node_id

    def processes(self) -> list[psutil.Process]:
        """This node's live processes: ``ray start`` and all it started (the raylet's
        workers included, which Ray starts in sessions of their own)."""
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self) -> None:
        """SIGKILL every process of the node at once (as a machine that lost power) and wait
        until they are gone."""
        doomed = self.processes()
        for proc in doomed:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(proc) for proc in doomed) and time.monotonic() < deadline:
            time.sleep(0.1)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LocalCluster:
    """A Ray cluster of :class:`LocalNode` s on this machine: a head, then nodes that join it,
    each started in ``cwd`` with a Ray temp folder and a log under ``root`` (keep ``root`` short:
    Ray's socket paths live under it). ``address`` is the head's, for ``RAY_ADDRESS``."""

    def __init__(self, root: Path, cwd: Path):
        self.root, self.cwd = root, cwd
        self.port = free_port()
        self.address = f"{node_ip()}:{self.port}"
        self.nodes: list[LocalNode] = []

    def start(self, args: Sequence[str], name: str, *, cpus: int, head: bool = False, **options) -> LocalNode:
        """A node started with ``ray start`` ``args`` and ``cpus`` CPUs (returns at once)."""
        node = LocalNode([*args, f"--num-cpus={cpus}"], temp_dir=self.root / f"t{len(self.nodes)}", cwd=self.cwd,
                         log=self.root / f"{name}.log", head=head, **options)
        self.nodes.append(node)
        return node

    def start_head(self, cpus: int, env: Mapping[str, str] = FAST_HEALTH_CHECK) -> LocalNode:
        """The head (on ``address``), once it is up."""
        return self.join(["--head", f"--port={self.port}"], "head", 1, cpus=cpus, head=True, env=dict(env))

    def add_node(self, cpus: int, name: str = "worker") -> LocalNode:
        """One more node, once the cluster counts it alive."""
        alive = len([node for node in self.nodes if node.process.poll() is None])
        return self.join([f"--address={self.address}"], name, alive + 1, cpus=cpus)

    def join(self, args: Sequence[str], name: str, count: int, *, attempts: int = 3, **options) -> LocalNode:
        """Start a node and return once the cluster has ``count`` alive nodes. A node whose
        ``ray start`` gave up is started again: Ray gives a raylet 30 s to register, which a
        loaded machine can exceed."""
        logs = []
        for attempt in range(attempts):
            node = self.start(args, f"{name}-{attempt}", **options)
            logs.append(self.root / f"{name}-{attempt}.log")
            deadline = time.monotonic() + 300
            while node.process.poll() is None and time.monotonic() < deadline:
                if self.joined(count):
                    return node
            node.kill()
        raise AssertionError(f"node {name} did not join in {attempts} tries:\n{logs[-1].read_text()[-3000:]}")

    def joined(self, count: int, timeout_s: float = 10) -> bool:
        """Whether the cluster has ``count`` alive nodes within ``timeout_s`` (asked from a
        process of its own, so that this one never connects to Ray)."""
        try:
            done = subprocess.run([sys.executable, "-c", _COUNT_NODES, self.address, str(count), str(timeout_s)],
                                  capture_output=True, text=True, timeout=timeout_s + 60,
                                  env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def stop(self) -> None:
        """Kill every node, the head last."""
        for node in reversed(self.nodes):
            node.kill()


#: argv: address, count, timeout (s); exits 0 once the cluster has that many alive nodes.
_COUNT_NODES = """
import sys, time, ray
address, count, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + timeout_s
while sum(node["Alive"] for node in ray.nodes()) < count:
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.2)
"""
