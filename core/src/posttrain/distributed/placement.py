"""Where a worker group's ranks run: the bundles of its placement group, which rank goes on
which bundle, and which GPUs a process was given.

A group that asks for no GPU gets one bundle per ``ranks_per_bundle`` consecutive ranks
(``{"CPU": cpus * ranks_per_bundle}``), which Ray places on a single node.

A group that asks for GPUs gets **one bundle per GPU**, each holding a whole GPU, so that
no two ranks of a group ever share a device, and a fraction (``gpus: 0.5``) only ever shares
its GPU with the group colocated with it:

- a worker holds ``devices_per_worker`` consecutive bundles (1, or an engine's
  tensor-parallel size); its actor goes on the first, with its CPUs. With one device it
  asks Ray for its share of that GPU itself; with several it asks for none and starts
  processes of its own on its bundles (:func:`device_bundles`), each taking
  :attr:`Layout.gpus_per_device` of its GPU;
- the bundles of ``ranks_per_bundle`` consecutive ranks (a tensor-parallel group) form a
  **node group**: they must share a node (:class:`~posttrain.distributed.cluster.VirtualCluster`
  pins them there);
- a colocated **guest** group (the engines of a policy) is laid out on the bundles of its
  host: engine ``e`` of ``E`` on the host's devices from ``e * D // E`` on (of ``D``), each
  of its devices a node group with the host's ranks there. Both groups' CPUs are in the
  bundles their actors go on.

Ranks are ordered by node (nodes in the order of their first bundle, bundles in index order
within a node), so ``LOCAL_RANK`` counts up on each node and rank 0 is on the first node.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import attrs
import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup

from posttrain.errors import WorkerError

#: The bundles (indices in the worker's placement group) on which a worker that spans
#: several GPUs starts its processes, comma-separated; set in such a worker's environment.
DEVICE_BUNDLES_VAR = "POSTTRAIN_DEVICE_BUNDLES"
#: The share of one GPU each of those processes asks Ray for (1, or a fraction when colocated).
GPUS_PER_DEVICE_VAR = "POSTTRAIN_GPUS_PER_DEVICE"


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
class DeviceBundles:
    """The GPUs a worker spans through processes of its own (an engine's tensor-parallel
    workers): bundles of its placement group, one GPU each, and the share of that GPU each
    process asks Ray for."""

    bundles: tuple[int, ...]
    gpus_per_device: float


def device_bundles() -> DeviceBundles | None:
    """The :class:`DeviceBundles` of the calling worker; None for a worker that holds its
    GPU itself or has none."""
    listed = os.environ.get(DEVICE_BUNDLES_VAR)
    if not listed:
        return None
    return DeviceBundles(tuple(int(b) for b in listed.split(",")), float(os.environ[GPUS_PER_DEVICE_VAR]))


def gpus_given() -> bool:
    """Whether the calling process was given GPUs to compute on: in a Ray actor, GPUs Ray
    assigned to it or :func:`device_bundles` for processes of its own; outside Ray actors
    (a test building a worker in process), whether CUDA is available. Ray hides every GPU
    from an actor that asked for none (``CUDA_VISIBLE_DEVICES=""``, see
    :func:`~posttrain.distributed.cluster.init_ray`)."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return bool(ray.get_gpu_ids()) or device_bundles() is not None
    import torch

    return torch.cuda.is_available()


def uses_cuda() -> bool:
    """Whether the calling process computes on CUDA itself: it was given GPUs of its own
    (:func:`gpus_given`, less an engine's GPUs for processes of its own). Raises
    :class:`~posttrain.errors.WorkerError` when Ray gave it GPUs but torch sees none (a
    driver older than torch's CUDA build needs), instead of computing on the CPU."""
    import torch

    if not gpus_given() or device_bundles() is not None:
        return False
    if not torch.cuda.is_available():
        raise WorkerError(
            f"this worker was given GPU(s) {ray.get_gpu_ids()} by Ray, but torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda}) sees no CUDA device: the NVIDIA driver is missing or older than that CUDA needs "
            "(nvidia-smi shows the newest CUDA the driver supports). Install a torch build for that CUDA version "
            "(https://pytorch.org/get-started/locally/), or run on the CPU (resources.gpus: 0, cluster.use_gpus: false)."
        )
    return True


@attrs.frozen
class Shape:
    """What a worker group asks for: ``num_workers`` workers of ``cpus`` CPUs and ``gpus``
    GPUs each, ``ranks_per_bundle`` consecutive ranks on one node, each worker spanning
    ``devices_per_worker`` GPUs (``gpus`` over them, a share of each)."""

    num_workers: int
    cpus: float
    gpus: float
    ranks_per_bundle: int = 1
    devices_per_worker: int = 1

    @property
    def on_gpus(self) -> bool:
        return self.gpus > 0

    @property
    def num_devices(self) -> int:
        """GPUs the group spans (0 without GPUs)."""
        return self.num_workers * self.devices_per_worker if self.on_gpus else 0

    @property
    def gpus_per_device(self) -> float:
        """The share of each of its GPUs a process of the group takes (0 without GPUs)."""
        return self.gpus / self.devices_per_worker if self.on_gpus else 0.0


@attrs.frozen
class Layout:
    """The bundles of one placement group and where each worker goes on them.

    ``workers``: per worker (in order of the ``Shape``'s ranks), the bundles it spans, its
    actor on the first. ``node_groups``: sets of consecutive bundles that must share a node.
    ``gpus_per_device``: what a process asks Ray for on each bundle it computes on.
    """

    bundles: tuple[dict[str, float], ...]
    node_groups: tuple[tuple[int, ...], ...]
    workers: tuple[tuple[int, ...], ...]
    gpus_per_device: float = 0.0
    guest_workers: tuple[tuple[int, ...], ...] = ()
    guest_gpus_per_device: float = 0.0


def layout(host: Shape, guest: Shape | None = None) -> Layout:
    """The :class:`Layout` of ``host``'s placement group, with ``guest`` (a colocated group
    that shares the host's GPUs) laid out on it. A guest needs GPUs on both sides, at most
    one device per host device, and the two shares of a GPU within one whole GPU."""
    if not host.on_gpus:
        k = host.ranks_per_bundle
        bundle = {"CPU": host.cpus * k} if host.cpus > 0 else {}
        count = host.num_workers // k
        return Layout(tuple(dict(bundle) for _ in range(count)), tuple((i,) for i in range(count)),
                      tuple((r // k,) for r in range(host.num_workers)))
    per_worker, devices = host.devices_per_worker, host.num_devices
    cpus = [0.0] * devices
    workers = tuple(tuple(range(r * per_worker, (r + 1) * per_worker)) for r in range(host.num_workers))
    for worker in workers:
        cpus[worker[0]] += host.cpus
    span = host.ranks_per_bundle * per_worker
    spans = [range(start, start + span) for start in range(0, devices, span)]
    guest_workers: tuple[tuple[int, ...], ...] = ()
    if guest is not None:
        if not guest.on_gpus or guest.num_devices > devices:
            raise ValueError(f"a guest of {guest.num_devices} GPUs cannot share a host's {devices}")
        if host.gpus_per_device + guest.gpus_per_device > 1 + 1e-9:
            raise ValueError(f"shares {host.gpus_per_device:g} + {guest.gpus_per_device:g} of one GPU exceed it")
        starts = [e * devices // guest.num_workers for e in range(guest.num_workers)]
        guest_workers = tuple(tuple(range(s, s + guest.devices_per_worker)) for s in starts)
        for worker in guest_workers:
            cpus[worker[0]] += guest.cpus
        spans += [range(worker[0], worker[-1] + 1) for worker in guest_workers]
    bundle_gpus = float(max(1, math.ceil(host.gpus_per_device - 1e-9)))
    bundles = tuple({**({"CPU": c} if c > 0 else {}), "GPU": bundle_gpus} for c in cpus)
    return Layout(bundles, merged(spans, devices), workers, host.gpus_per_device, guest_workers,
                  guest.gpus_per_device if guest is not None else 0.0)


def merged(spans: Sequence[range], count: int) -> tuple[tuple[int, ...], ...]:
    """``range(count)`` cut into the fewest runs of consecutive indices such that each span
    lies within one run."""
    reach = list(range(count))  # reach[i]: the last index that must share a run with i
    for span in spans:
        for index in span:
            reach[index] = max(reach[index], span[-1])
    runs: list[tuple[int, ...]] = []
    start, end = 0, -1
    for index in range(count):
        end = max(end, reach[index])
        if index == end:
            runs.append(tuple(range(start, end + 1)))
            start = index + 1
    return tuple(runs)


@attrs.frozen
class Placement:
    """A worker group's placement group and, per rank (in rank order), the bundle its actor
    runs on, that bundle's Ray node id, the bundles it computes on (GPU groups; empty
    without GPUs) and the GPUs its actor asks Ray for."""

    group: PlacementGroup
    bundles: tuple[int, ...]
    nodes: tuple[str, ...]
    devices: tuple[tuple[int, ...], ...] = ()
    actor_gpus: float = 0.0
    gpus_per_device: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.bundles)

    def device_env(self, rank: int) -> dict[str, str]:
        """The environment that tells rank ``rank`` the bundles it starts processes on
        (:func:`device_bundles`): set for a rank that spans several GPUs, else empty."""
        if not self.devices or len(self.devices[rank]) < 2:
            return {}
        return {DEVICE_BUNDLES_VAR: ",".join(map(str, self.devices[rank])),
                GPUS_PER_DEVICE_VAR: f"{self.gpus_per_device:g}"}


def placed(group: PlacementGroup, bundle_nodes: Sequence[str], workers: Sequence[tuple[int, ...]], *,
           on_gpus: bool, gpus_per_device: float = 0.0) -> Placement:
    """The :class:`Placement` of ``workers`` (the bundles of each, as :attr:`Layout.workers`)
    on ``group``, whose bundle i is on node ``bundle_nodes[i]``: ranks ordered by node (nodes
    in the order of their first bundle, then by bundle; ranks of one bundle keep their order)."""
    first_seen: dict[str, int] = {}
    for index, node in enumerate(bundle_nodes):
        first_seen.setdefault(node, index)
    ranked = sorted(workers, key=lambda bundles: (first_seen[bundle_nodes[bundles[0]]], bundles[0]))
    first = tuple(bundles[0] for bundles in ranked)
    return Placement(
        group, first, tuple(bundle_nodes[b] for b in first),
        devices=tuple(ranked) if on_gpus else (),
        actor_gpus=gpus_per_device if on_gpus and all(len(bundles) == 1 for bundles in ranked) else 0.0,
        gpus_per_device=gpus_per_device,
    )


def follow_nodes(leader_nodes: Sequence[str], num_bundles: int) -> list[dict[str, str]]:
    """Ray bundle label selectors that put bundle ``j`` of ``num_bundles`` on the node of
    the leader's rank ``j * len(leader_nodes) // num_bundles`` (the leader's ranks shared out
    evenly, in order): a colocated group's workers on the nodes of the ranks they share
    devices with."""
    return [{NODE_ID_LABEL_KEY: leader_nodes[j * len(leader_nodes) // num_bundles]} for j in range(num_bundles)]


def pinned(node: str) -> dict[str, str]:
    """The bundle label selector that puts a bundle on Ray node ``node``."""
    return {NODE_ID_LABEL_KEY: node}
