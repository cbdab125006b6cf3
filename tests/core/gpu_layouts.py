"""Worker-group layouts on a Ray cluster that declares GPUs it does not have (Ray's logical
GPUs: ``num_gpus`` on a CPU machine), as posttrain places them; run as a script, it prints
what each rank was given as one JSON line.

``python -m tests.core.gpu_layouts 1x4 2x4 ...`` starts each cluster in turn (one node: the
local Ray a run starts itself, through ``cluster.num_gpus``; several: Ray's test cluster of
nodes on this machine), then, for each :data:`SCENARIOS` entry that fits it, reserves a
``policy`` group, a ``generation`` group (colocated with the policy or not) and a one-rank
``environment`` group without GPUs through :class:`~posttrain.distributed.cluster.VirtualCluster`,
and runs a probe on every rank with exactly the options its actor would get
(:func:`~posttrain.distributed.worker_group.rank_options`, :func:`rank_environments`).
A probe is a Ray task, not an actor: tasks reuse worker processes, so the whole matrix takes
seconds, and a GPU id comes from the bundle either way. A generation rank that spans several
GPUs (tensor parallel) asks for none itself; its probe starts one task per bundle it was
given, with its share of that GPU, as its engine's processes would.

A topology written ``1x4:actors`` also runs the colocated tensor-parallel scenario through
:class:`~posttrain.distributed.worker_group.WorkerGroup` itself (real actors), to show they get
what the probes report; on several nodes, a tensor-parallel group wider than a node is
refused (``too-wide``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import ray

from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed.cluster import Colocated, VirtualCluster
from posttrain.distributed.placement import Placement, Shape, device_bundles, uses_cuda
from posttrain.distributed.worker_group import Worker, WorkerGroup, rank_environments, rank_options
from posttrain.errors import ConfigError, WorkerError

#: (name, the cluster's GPUs the policy spans, its GPUs per rank, its tensor-parallel size, the
#: GPUs the engines span, GPUs per engine, an engine's tensor-parallel size, colocated): each
#: scenario the cluster has GPUs for runs.
SCENARIOS = [
    ("colocated-tp1", "all", 0.5, 1, "all", 0.5, 1, True),
    ("colocated-tp2", "all", 0.5, 2, "half", 1.0, 2, True),
    ("separate-tp1", "half", 1.0, 1, "half", 1.0, 1, False),
    ("separate-tp2", "half", 1.0, 2, "half", 2.0, 2, False),
]


def where(env: dict[str, str]) -> dict[str, Any]:
    """What a rank sees: its node, Ray's GPU ids for it, ``CUDA_VISIBLE_DEVICES``, and the
    bundles and share of a rank that spans several GPUs (``env``: the variables its actor
    would set, set here only while the probe reads them, since tasks share processes)."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        spans = device_bundles()
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "gpus": [str(g) for g in ray.get_gpu_ids()],
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "spans": None if spans is None else {"bundles": list(spans.bundles), "share": spans.gpus_per_device},
    }


def device_gpus(group: Any, bundle: int, share: float) -> dict[str, Any]:
    """What one process of a multi-GPU rank gets on ``bundle`` with ``share`` of its GPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
    return ray.get(probe.options(num_cpus=0, num_gpus=share, scheduling_strategy=strategy).remote({}))


@ray.remote
def probe(env: dict[str, str]) -> dict[str, Any]:
    return where(env)


def probe_group(placement: Placement, resources: WorkerResources) -> list[dict[str, Any]]:
    """Each rank's view, one task at a time (one worker process serves them all)."""
    seen = []
    for rank, env in enumerate(rank_environments(placement)):
        view = ray.get(probe.options(**rank_options(placement, rank, resources)).remote(env))
        if view["spans"] is not None:
            view["devices"] = [device_gpus(placement.group, b, view["spans"]["share"])
                               for b in view["spans"]["bundles"]]
        seen.append(view)
    return seen


def sizes(gpus: int, count: str) -> int:
    return {"all": gpus, "half": gpus // 2}[count]


def run_scenario(config: ClusterConfig, total_gpus: int, scenario: tuple) -> dict[str, Any]:
    name, policy_n, policy_gpus, policy_tp, engines_n, engine_gpus, engine_tp, colocated = scenario
    policy_workers, engines = sizes(total_gpus, policy_n), sizes(total_gpus, engines_n) // engine_tp
    if policy_workers < max(1, policy_tp) or engines < 1 or policy_workers % policy_tp:
        return {"skipped": True}
    policy = WorkerResources(cpus=1, gpus=policy_gpus)
    engine = WorkerResources(cpus=1, gpus=engine_gpus)
    colocate = {"generation": Colocated("policy", Shape(engines, 1, engine_gpus, 1, engine_tp))} if colocated else {}
    cluster = VirtualCluster(config, colocate=colocate, placement_timeout_s=30)
    try:
        placements = {
            "policy": (cluster.reserve("policy", policy_workers, policy, ranks_per_bundle=policy_tp), policy),
            "generation": (cluster.reserve("generation", engines, engine, devices_per_worker=engine_tp), engine),
            "environment": (cluster.reserve("environment", 1, WorkerResources(cpus=1)), WorkerResources(cpus=1)),
        }
        seen = {group: probe_group(*held) for group, held in placements.items()}
    except Exception as error:  # reported, so that one broken layout does not hide the others
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        cluster.shutdown()
    return {"policy_tp": policy_tp, "engine_tp": engine_tp, "colocated": colocated, **seen}


class Where(Worker):
    """The probe as a worker-group actor; it also says whether a backend worker would
    compute on CUDA there (:func:`~posttrain.distributed.placement.uses_cuda`), which on a
    machine without CUDA is an error for an actor given GPUs."""

    def where(self) -> dict[str, Any]:
        try:
            cuda: bool | str = uses_cuda()
        except WorkerError as error:
            cuda = str(error)
        return {**where({}), "uses_cuda": cuda}


def run_actors(config: ClusterConfig, total_gpus: int) -> dict[str, Any]:
    """The colocated tensor-parallel scenario through real worker groups."""
    engines = total_gpus // 2
    cluster = VirtualCluster(config, colocate={"generation": Colocated("policy", Shape(engines, 1, 1.0, 1, 2))},
                             placement_timeout_s=30)
    groups = [
        WorkerGroup(cluster, Where, name="policy", num_workers=total_gpus, resources=WorkerResources(cpus=1, gpus=0.5),
                    ranks_per_bundle=2),
        WorkerGroup(cluster, Where, name="generation", num_workers=engines,
                    resources=WorkerResources(cpus=1, gpus=1.0), devices_per_worker=2),
        WorkerGroup(cluster, Where, name="environment", num_workers=1, resources=WorkerResources(cpus=1)),
    ]
    try:
        seen = {group.name: group.run_all(Where.where) for group in groups}
        placement = cluster.placements()["generation"]
        for view in seen["generation"]:
            view["devices"] = [device_gpus(placement.group, b, view["spans"]["share"]) for b in view["spans"]["bundles"]]
        return {"policy_tp": 2, "engine_tp": 2, "colocated": True, **seen}
    finally:
        for group in groups:
            group.shutdown()
        cluster.shutdown()


def too_wide(config: ClusterConfig, total_gpus: int) -> str:
    """The error of a tensor-parallel group of every GPU of the cluster (wider than a node)."""
    cluster = VirtualCluster(config)
    try:
        cluster.reserve("policy", total_gpus, WorkerResources(cpus=1, gpus=1), ranks_per_bundle=total_gpus)
    except ConfigError as error:
        return str(error)
    finally:
        cluster.shutdown()
    return ""


def on_topology(nodes: int, per_node: int, *, actors: bool) -> dict[str, Any]:
    """Every scenario on a cluster of ``nodes`` nodes of ``per_node`` GPUs (one node: the
    local Ray a run starts itself; several: Ray's test cluster of nodes on this machine)."""
    cpus = 4 * per_node + 4
    head = None
    if nodes == 1:
        config = ClusterConfig(num_cpus=cpus, num_gpus=per_node, use_gpus=True)
    else:
        from ray.cluster_utils import Cluster

        head = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "num_gpus": per_node,
                                                              "include_dashboard": False})
        for _ in range(nodes - 1):
            head.add_node(num_cpus=cpus, num_gpus=per_node)
        config = ClusterConfig(ray_address=head.address, num_nodes=nodes, use_gpus=True)
    total = nodes * per_node
    try:
        results = {scenario[0]: run_scenario(config, total, scenario) for scenario in SCENARIOS}
        if actors:
            results["actors"] = run_actors(config, total)
        if nodes > 1:
            results["too-wide"] = too_wide(config, total)
        return results
    finally:
        ray.shutdown()
        if head is not None:
            head.shutdown()


def main(argv: list[str]) -> None:
    """``NODESxGPUS[:actors] ...``: each topology in turn, one JSON line of all results."""
    results = {}
    for topology in argv:
        shape, _, extra = topology.partition(":")
        nodes, per_node = (int(n) for n in shape.split("x"))
        results[shape] = on_topology(nodes, per_node, actors=extra == "actors")
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
