"""The driver side of the dtensor policy: a :class:`~posttrain.backend.policy_driver.ShardedPolicy`
over :class:`~posttrain_dtensor.worker.DTensorPolicyWorker` ranks.

Rank ``r`` of the group is data-parallel rank ``r // tp`` and tensor-parallel rank
``r % tp`` (the mesh is ``(dp, tp)`` in row-major order): each pass sends the same shard to
the tensor-parallel ranks of a replica and keeps tensor-parallel rank 0's result.
"""

from __future__ import annotations

from posttrain.backend.policy_driver import ShardedPolicy
from posttrain.config.schema import RunConfig
from posttrain.config.validate import policy_in_driver_by_default, validate_config
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain.plugins import plugin_host
from posttrain_dtensor.config import SECTION, DTensorConfig
from posttrain_dtensor.worker import DTensorPolicyWorker


class DTensorPolicy(ShardedPolicy):
    """A :class:`~posttrain.interfaces.Policy` trained with FSDP2 / tensor parallel.
    ``policy.in_driver`` left null (a policy built directly rather than by a run, which
    decides it first) is decided as a run decides it."""

    def __init__(self, config: RunConfig, cluster: VirtualCluster, *, name: str = "policy", reference: bool = True):
        validate_config(config)  # what a run checks, for policies built directly from a RunConfig
        options = config.sections.get(SECTION) or DTensorConfig()
        p = config.policy
        tp = p.tensor_parallel_size
        in_driver = p.in_driver if p.in_driver is not None else policy_in_driver_by_default(config, plugin_host())
        group = WorkerGroup(
            cluster, DTensorPolicyWorker, name=name, num_workers=p.num_workers, resources=p.resources,
            ranks_per_bundle=tp,  # a tensor-parallel group (consecutive ranks) on one node
            args=(config, options, reference), in_driver=in_driver,
        )
        super().__init__(config, group, dp_rank_of=[r // tp for r in range(p.num_workers)],
                         result_ranks=list(range(0, p.num_workers, tp)), reference=reference)
        self.tp_size = tp
