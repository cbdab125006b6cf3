"""Ray runtime: the virtual cluster (placement groups) and worker groups of actors."""

from posttrain.distributed.cluster import VirtualCluster, init_ray
from posttrain.distributed.worker_group import Worker, WorkerGroup

__all__ = ["VirtualCluster", "Worker", "WorkerGroup", "init_ray"]
