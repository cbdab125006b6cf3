"""The driver side of the megatron policy: a :class:`~posttrain.backend.policy_driver.ShardedPolicy`
over :class:`~posttrain_megatron.worker.MegatronPolicyWorker` ranks.

megatron-core decides which rank is which (its order is tensor, context, data, then
pipeline parallel); the driver asks every rank for its coordinates once, sends each rank
its data-parallel replica's work and takes each replica's results from the rank that
holds them (tensor and context parallel rank 0 of the last pipeline stage).
"""

from __future__ import annotations

from posttrain.backend.policy_driver import ShardedPolicy
from posttrain.config.schema import RunConfig
from posttrain.config.validate import validate_config
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain_megatron.config import options_of
from posttrain_megatron.worker import MegatronPolicyWorker


class MegatronPolicy(ShardedPolicy):
    """A :class:`~posttrain.interfaces.Policy` trained with megatron-core: tensor, pipeline,
    context and data parallel, sequence parallel, the distributed optimizer."""

    def __init__(self, config: RunConfig, cluster: VirtualCluster, *, name: str = "policy", reference: bool = True):
        validate_config(config)  # what a run checks, for policies built directly from a RunConfig
        p = config.policy
        group = WorkerGroup(
            cluster, MegatronPolicyWorker, name=name, num_workers=p.num_workers, resources=p.resources,
            ranks_per_bundle=p.tensor_parallel_size,  # a tensor-parallel group (consecutive ranks) on one node
            args=(config, options_of(config), reference),
        )
        try:
            coordinates = group.run_all(MegatronPolicyWorker.coordinates)
        except BaseException:
            group.shutdown()
            raise
        holders = sorted((c["dp"], rank) for rank, c in enumerate(coordinates) if c["holds_results"])
        super().__init__(config, group, dp_rank_of=[c["dp"] for c in coordinates],
                         result_ranks=[rank for _, rank in holders], reference=reference)
        self.coordinates = coordinates
