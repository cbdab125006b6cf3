"""GRPO on a cluster of two Ray nodes on this machine, started with the commands of
docs/clusters.md ("An existing Ray cluster": ``ray start --head``, ``ray start --address``,
then ``RAY_ADDRESS=... posttrain run ...``), each node with its own raylet, 3 CPUs and a
working directory other than the run's:

- the tiny model's GRPO run puts one policy rank on each node (2 CPUs each) and the engine
  on rank 0's node, with the config's relative paths (model, run_dir) resolved as in the
  driver on both nodes, and finishes;
- worker groups over the two nodes: tensor-parallel pairs each inside one node, ranks
  ordered by node, colocated workers on their ranks' nodes;
- the node without the driver killed mid-run (every process of it, SIGKILL): the run exits
  within 30 s with an error naming that node; the node started again, the same command
  waits for it, resumes from the checkpoint and logs the uninterrupted run's metrics;
- a third node that does not see the run directory (its own mount namespace, a tmpfs over
  the runs folder): the run stops before any step, naming that node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.run.metrics import read_metrics
from posttrain.testing.ray_nodes import FAST_HEALTH_CHECK, LocalCluster, LocalNode, node_ip
from tests.docs.commands import command_lines
from tests.docs.pages import REPO, blocks

pytestmark = [pytest.mark.ray, pytest.mark.slow]

POSTTRAIN = str(Path(sys.executable).parent / "posttrain")
DOCS_HEAD = "10.0.0.1"  # the head's address and port in the docs' commands
DOCS_PORT = "6379"
NODE_CPUS = 3
STEPS = 5
#: The test's sizes, after the docs' command: 2 CPUs per policy rank puts one on each 3-CPU
#: node; few small steps; a checkpoint every 2 steps.
SIZES = (
    "policy.resources.cpus=2", "generation.resources.cpus=1", f"grpo.max_num_steps={STEPS}",
    "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=4", "policy.logprob_micro_batch_size=4", "grpo.val_at_start=false",
    "grpo.val_period=0", "checkpointing.save_period=2", "logger.progress_bar=false", "cluster.node_wait_s=120",
)
#: Metrics that measure time, not what was computed.
TIMING_PREFIXES = ("timing/", "throughput/", "refit/seconds", "step_time_s", "time")


def docs_commands() -> tuple[list[str], list[str], list[str]]:
    """The docs' three commands: the head's ``ray start``, another node's, and the run."""
    (block,) = [b for b in blocks("clusters.md") if b.language == "bash" and "ray start --head" in b.text]
    head, worker, run = command_lines(block.text)
    assert head[:3] == ["ray", "start", "--head"] and worker[:2] == ["ray", "start"], block.where
    assert run[0] == f"RAY_ADDRESS={DOCS_HEAD}:{DOCS_PORT}" and run[1:3] == ["posttrain", "run"], block.where
    return head, worker, run


class RunProcess:
    """``posttrain run`` in a process of its own, its stderr in a file."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], stderr: Path):
        self.stderr = stderr
        with open(stderr, "w") as log:
            self.process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log)

    def finish(self, timeout_s: float = 900) -> tuple[int, str]:
        """Its exit status and what it wrote to stderr."""
        code = self.process.wait(timeout=timeout_s)
        return code, self.stderr.read_text()


class TwoNodes(LocalCluster):
    """The docs' cluster on this machine: the head and one more node, in ``root``."""

    def __init__(self, root: Path):
        elsewhere = root / "elsewhere"  # where the nodes start: not the run's folder
        elsewhere.mkdir()
        super().__init__(root, elsewhere)
        self.head_args, self.worker_args, self.run_words = (self.here(words) for words in docs_commands())
        self.runs = 0

    def launch(self) -> None:
        """Start the head, then the other node; return once both joined."""
        self.head = self.join(self.head_args[2:], "head", 1, cpus=NODE_CPUS, head=True, env=FAST_HEALTH_CHECK)
        self.worker = self.start_worker()

    def here(self, words: list[str]) -> list[str]:
        return [word.replace(DOCS_HEAD, node_ip()).replace(DOCS_PORT, str(self.port)) for word in words]

    def start_worker(self) -> LocalNode:
        """Start the other node (again) and wait until the cluster has 2 alive nodes."""
        return self.join(self.worker_args[2:], "worker", 2, cpus=NODE_CPUS)

    def run(self, cwd: Path, run_dir: str, *extra: str) -> RunProcess:
        """The docs' run command (its RAY_ADDRESS pointing here), with the test's sizes."""
        env = {**os.environ, self.run_words[0].split("=")[0]: self.run_words[0].split("=", 1)[1],
               "PYTHONUNBUFFERED": "1"}
        argv = [POSTTRAIN, *self.run_words[2:], *SIZES, f"run_dir={run_dir}", *extra]
        self.runs += 1
        return RunProcess(argv, cwd, env, cwd / f"run{self.runs}.stderr")


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodes]:
    root = Path(tempfile.mkdtemp(prefix="ptmn", dir="/tmp"))  # short: Ray's socket paths live under it
    nodes = TwoNodes(root)
    try:
        nodes.launch()
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The run's folder, as the docs' example expects it: examples/ and runs/tiny_model."""
    from posttrain.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("multinode")
    (root / "examples").symlink_to(REPO / "examples")
    build_tiny_model(root / "runs" / "tiny_model")
    return root


def logged_steps(run_dir: Path) -> set[int]:
    """The training steps in metrics.jsonl so far (a line being written is skipped)."""
    steps = set()
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("phase") == "train":
            steps.add(record["step"])
    return steps


def comparable(run_dir: Path) -> dict[int, dict]:
    """Each step's last logged training metrics, without those that measure time."""
    return {
        r["step"]: {k: v for k, v in r.items() if k != "phase" and not k.startswith(TIMING_PREFIXES)}
        for r in read_metrics(run_dir / "metrics.jsonl", "train")
    }


def events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record.get("event") == name]


@pytest.fixture(scope="module")
def uninterrupted(cluster, workspace) -> dict[int, dict]:
    code, stderr = cluster.run(workspace, "runs/whole").finish()
    assert code == 0, stderr[-3000:]
    metrics = comparable(workspace / "runs" / "whole")
    assert sorted(metrics) == list(range(1, STEPS + 1))
    return metrics


def short_ids(labels: list[str]) -> list[str]:
    """The node ids (as messages shorten them) in node labels."""
    return [re.fullmatch(r".* \(host .*, id ([0-9a-f]{12})\)", label)[1] for label in labels]


def test_grpo_spreads_its_policy_ranks_over_both_nodes(cluster, workspace, uninterrupted):
    placed = {record["group"]: short_ids(record["nodes"]) for record in events(workspace / "runs/whole", "workers placed")}
    policy, engines = placed["policy"], placed["generation"]
    assert sorted(policy) == sorted(node.node_id()[:12] for node in (cluster.head, cluster.worker))
    assert engines == policy[:1]  # one engine, colocated: on policy rank 0's node


PLACEMENT = """
import json, os
from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed import VirtualCluster, Worker, WorkerGroup
from posttrain.errors import ConfigError

class Where(Worker):
    def where(self):
        import ray
        return [ray.get_runtime_context().get_node_id()[:12], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]]

cluster = VirtualCluster(ClusterConfig(num_nodes=2), colocate={"engines": "ranks"})
one = WorkerResources(cpus=1)
ranks = WorkerGroup(cluster, Where, name="ranks", num_workers=4, resources=one, ranks_per_bundle=2)
engines = WorkerGroup(cluster, Where, name="engines", num_workers=2, resources=one)
refused = []
for name, workers, cpus in (("huge", 3, 3), ("wide", 1, 4)):
    try:
        cluster.reserve(name, workers, WorkerResources(cpus=cpus))
    except ConfigError as error:
        refused.append(str(error))
print(json.dumps({"ranks": ranks.run_all(Where.where), "engines": engines.run_all(Where.where), "refused": refused}))
"""


def test_tensor_parallel_pairs_share_a_node_and_colocated_workers_follow_them(cluster):
    """4 ranks in pairs (tensor parallel 2) on 3-CPU nodes: one pair per node, ranks ordered by
    node, local ranks 0 and 1 on each; 2 colocated workers on the nodes of ranks 0 and 2. A
    request the joined cluster cannot hold, in all or on any one node, names what each node
    has."""
    done = subprocess.run([sys.executable, "-c", PLACEMENT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": cluster.address})
    assert done.returncode == 0, done.stderr[-3000:]
    placed = json.loads(done.stdout.splitlines()[-1])
    ranks = placed["ranks"]
    nodes = [node for node, _, _ in ranks]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert sorted(set(nodes)) == sorted(node.node_id()[:12] for node in (cluster.head, cluster.worker))
    assert [local for _, local, _ in ranks] == ["0", "1", "0", "1"]
    assert {master for _, _, master in ranks} == {cluster.address.split(":")[0]}  # rank 0's node, across nodes
    assert [node for node, _, _ in placed["engines"]] == [nodes[0], nodes[2]]
    per_node = "; ".join(f"{node_ip()} (host {os.uname().nodename}, id {node.node_id()[:12]}): 3 CPU, 0 GPU"
                         for node in (cluster.head, cluster.worker))
    huge, wide = placed["refused"]
    assert huge.startswith("worker group 'huge' asked for 3 x {'CPU': 3.0} = 9 CPU in all, but the whole Ray "
                           f"cluster has 6 CPU. The Ray cluster at {cluster.address} has, per node: ")
    assert wide.startswith("worker group 'wide' asked for 1 x {'CPU': 4.0}, 4 CPU on one node, but the largest "
                           f"node has 3 CPU. The Ray cluster at {cluster.address} has, per node: ")
    for message in (huge, wide):
        assert set(message.split("per node: ")[1].split(". Lower")[0].split("; ")) == set(per_node.split("; "))
        assert message.endswith("or add nodes with more CPU to the cluster (cluster.num_cpus only sizes a cluster "
                                "the run starts itself).")


def test_a_lost_node_stops_the_run_naming_it_and_the_rerun_resumes(cluster, workspace, uninterrupted):
    run_dir = workspace / "runs" / "lost"
    run = cluster.run(workspace, "runs/lost")
    deadline = time.monotonic() + 900
    while 3 not in logged_steps(run_dir):
        assert run.process.poll() is None, run.stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, "step 3 was not logged"
        time.sleep(0.05)
    lost = cluster.worker.node_id()
    cluster.worker.kill()
    killed_at = time.monotonic()
    code, stderr = run.finish(timeout_s=120)
    stopped_after = time.monotonic() - killed_at
    assert code == 2, stderr[-3000:]
    assert stopped_after < 30, f"the run took {stopped_after:.1f} s to stop after its node was lost"
    print(f"the run stopped {stopped_after:.1f} s after its node was lost")  # shown by pytest -rP
    (error,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert " died on node " in error and f"id {lost[:12]})" in error, error
    saved = sorted(int(folder.name.split("_")[1]) for folder in (run_dir / "checkpoints").glob("step_*"))
    assert saved[0] == 2, saved

    cluster.worker = cluster.start_worker()  # a node with a new id on the same machine
    code, stderr = cluster.run(workspace, "runs/lost").finish()
    assert code == 0, stderr[-3000:]
    (resumed,) = events(run_dir, "resumed")
    assert resumed["step"] == saved[-1]
    assert comparable(run_dir) == uninterrupted


def test_a_node_without_the_run_directory_stops_the_run_before_any_step(cluster, workspace):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (a user and mount namespace) is not allowed here: no node can have its own mounts")
    runs = workspace / "runs"
    blind = cluster.join(cluster.worker_args[2:], "blind", 3, cpus=1,
                         wrapper=["unshare", "-rm", "sh", "-c", f'mount -t tmpfs none {runs} && exec "$0" "$@"'])
    blind_id = blind.node_id()
    try:
        code, stderr = cluster.run(workspace, "runs/hidden", "cluster.num_nodes=3").finish()
    finally:
        blind.kill()
    assert code == 2, stderr[-3000:]
    (error,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith(
        f"error: node {node_ip()} (host {os.uname().nodename}, id {blind_id[:12]}) cannot use run_dir "
        f"({runs / 'hidden'}): it cannot read the file the driver wrote there (FileNotFoundError: "
    ), error
    assert not logged_steps(runs / "hidden")
