"""Where a worker group's ranks run: the order of ranks over a placement group's bundles.

Ray places the bundles of a group; posttrain decides which rank goes on which bundle:

- **ranks ordered by node**: the ranks on one node are consecutive (nodes in the order of
  their first bundle, bundles in index order within a node), so ``LOCAL_RANK`` counts up on
  each node and rank 0 is on the first node;
- **groups of ranks inside one node**: with ``ranks_per_bundle = k`` (a tensor-parallel
  group), ranks ``k*i .. k*i+k-1`` share bundle ``i``, which Ray places on a single node.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup


@attrs.frozen
class DevicePlacement:
    """Where one worker process computes: its Ray node and the GPUs Ray gave it (their ids
    on that node, as Ray counts them; empty on the CPU)."""

    node: str
    gpus: tuple[str, ...] = ()

    def shares_gpu_with(self, other: DevicePlacement) -> bool:
        """Whether the two processes have a GPU in common (fractional GPUs: colocated)."""
        return self.node == other.node and bool(set(self.gpus) & set(other.gpus))


def this_process_devices() -> DevicePlacement:
    """The :class:`DevicePlacement` of the calling process (node "" outside Ray)."""
    if not ray.is_initialized():
        return DevicePlacement("")
    context = ray.get_runtime_context()
    return DevicePlacement(context.get_node_id(), tuple(str(g) for g in context.get_accelerator_ids().get("GPU", [])))


@attrs.frozen
class Placement:
    """A worker group's placement group and, per rank (in rank order), the index of the
    bundle it runs on and that bundle's Ray node id."""

    group: PlacementGroup
    bundles: tuple[int, ...]
    nodes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.bundles)


def rank_order(bundle_nodes: Sequence[str], ranks_per_bundle: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(bundle of each rank, node of each rank)`` for bundles on ``bundle_nodes`` (the node
    of bundle i at index i), ``ranks_per_bundle`` ranks per bundle, ranks ordered by node."""
    first_seen: dict[str, int] = {}
    for index, node in enumerate(bundle_nodes):
        first_seen.setdefault(node, index)
    ordered = sorted(range(len(bundle_nodes)), key=lambda index: (first_seen[bundle_nodes[index]], index))
    bundles = tuple(index for index in ordered for _ in range(ranks_per_bundle))
    return bundles, tuple(bundle_nodes[index] for index in bundles)


def follow_nodes(leader_nodes: Sequence[str], num_bundles: int) -> list[dict[str, str]]:
    """Ray bundle label selectors that put bundle ``j`` of ``num_bundles`` on the node of
    the leader's rank ``j * len(leader_nodes) // num_bundles`` (the leader's ranks shared out
    evenly, in order): a colocated group's workers on the nodes of the ranks they share
    devices with."""
    return [{NODE_ID_LABEL_KEY: leader_nodes[j * len(leader_nodes) // num_bundles]} for j in range(num_bundles)]
