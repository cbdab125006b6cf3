"""Weight sync, worker to worker: the policy's ranks broadcast their weights straight to the
generation engines; the driver only tells them when (and under which version).

Setup, once per pair of policy and generation backend: the driver hands every policy rank
the generation backend's :class:`BroadcastEndpoint` (actor handles and the transport to use,
no tensors). Policy rank 0 opens a rendezvous store on a port of its node that the OS assigns and, through
the engines' own actor handles, asks every engine to join a process group with it
(:meth:`EngineWorker.init_weight_transfer`), telling them, once, the parameters' names,
shapes and dtypes and how they are cut into buckets (:class:`TransferPlan`).

Each sync: the driver calls ``send_weights(version)`` on every policy rank. Rank 0 asks every
engine to receive (``receive_weights(version)``, an actor call of its own), waits until
every engine rank has started receiving (an engine takes one call at a time: one busy with
a generate call takes the sync after it; at most ``refit_wait_s``), then broadcasts
the weights: the ranks gather one layer group at a time (:func:`layer_groups`, a collective
of the backend's ``gather_weights``), rank 0 packs the full tensors into buckets of at most
``generation.refit_bucket_bytes`` and broadcasts each bucket as one flat byte buffer; the
engines cut the same buffer back into tensors (both sides derive the cuts from the plan)
and load them. At most one layer group and one bucket are staged on rank 0.

The transport is a torch.distributed process group made for the sync only (a
``TCPStore`` rendezvous and a ``ProcessGroupGloo``, or ``ProcessGroupNCCL`` on CUDA), so it
coexists with whatever groups the trainer and the engines already run. Two same-device cases
skip the broadcast: engines on rank 0's node on the CPU map a shared-memory file, and engines
on rank 0's own GPU (colocated, where NCCL refuses two ranks of one group on one GPU) map rank
0's staging buffer through a CUDA IPC handle; the group (gloo) then only signals.

Checksums (``generation.refit_checksums``, a plan with ``checksums``): each bucket ends with
a :func:`checksum` of every tensor in it, taken by rank 0 from the tensor it packed; the
receivers check what arrived against them (:meth:`BroadcastReceiver.receive`) and keep them
(:attr:`BroadcastReceiver.sent_checksums`), so that an engine can compare the tensors it
loaded into its model with the trainer's values (:func:`checksums_match`).
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from posttrain.backend.hf_export import bucket_names
from posttrain.errors import ProcessDied, WorkerError
from posttrain.interfaces.generation import RefitStats

if TYPE_CHECKING:
    from posttrain.distributed.placement import DevicePlacement

#: Seconds a broadcast, or joining the group, may wait for a peer before failing
#: (``generation.weight_sync_timeout_s``).
DEFAULT_TIMEOUT_S = 120.0
#: Seconds a sync waits for every engine to start receiving, e.g. after the generate call it
#: is busy with (``generation.refit_wait_s``). The policy's other ranks wait as long in their
#: first gather, so it stays below their collective timeout (NCCL's default: 10 minutes).
DEFAULT_REFIT_WAIT_S = 300.0
#: Each tensor starts at a multiple of this many bytes in a bucket's buffer.
ALIGN_BYTES = 16
#: Where a same-node CPU sync keeps its shared-memory bucket (a tmpfs).
SHARED_MEMORY_DIR = "/dev/shm"


@attrs.frozen
class ParamMeta:
    """One exported tensor: its Hugging Face name, full shape and dtype (``"float32"``...)."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def layer_groups(names: Sequence[str]) -> list[list[str]]:
    """``names`` cut into gather groups: one per decoder layer (the first integer in a name,
    ``model.layers.7.mlp.up_proj.weight`` -> layer 7), the names before the first layer
    (embeddings) as a group of their own, and those after it (final norm, output
    embedding) as the last group. Order within a group is the order of ``names``."""
    before: list[str] = []
    after: list[str] = []
    layers: dict[int, list[str]] = {}
    for name in names:
        index = next((int(part) for part in name.split(".") if part.isdigit()), None)
        if index is None:
            (after if layers else before).append(name)
        else:
            layers.setdefault(index, []).append(name)
    groups = [before] if before else []
    groups += [layers[index] for index in sorted(layers)]
    return groups + ([after] if after else [])


def bucket_layout(metas: Sequence[ParamMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices into ``metas`` per bucket: consecutive tensors while they fit in
    ``bucket_bytes``; a tensor larger than that is a bucket of its own (as
    :func:`posttrain.backend.hf_export.bucket_names` cuts them)."""
    if bucket_bytes <= 0:
        raise ValueError(f"the weight-sync bucket size must be positive (generation.refit_bucket_bytes), got {bucket_bytes}")
    index = {meta.name: i for i, meta in enumerate(metas)}
    return [[index[name] for name in names] for names in bucket_names([(m.name, m.nbytes) for m in metas], bucket_bytes)]


def checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """``(sum, sum of absolute values)`` of ``tensor``'s elements, in float64: the same for any
    layout of the same values (a fused or padded-with-zeros copy of it, pieces of it stacked
    with others), which is what a receiver that stores tensors its own way can compare."""
    values = tensor.detach().to(torch.float64)
    return float(values.sum()), float(values.abs().sum())


def checksums_match(expected: tuple[float, float], found: tuple[float, float], dtype: torch.dtype) -> bool:
    """Whether ``found`` holds the values of ``expected`` up to rounding each value to
    ``dtype`` (at most ``eps`` of it, relative, per value, so at most ``eps`` times the sum of
    absolute values in all)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    tolerance = 2 * eps * max(expected[1], found[1]) + 1e-9 * (1 + expected[1])
    return abs(expected[0] - found[0]) <= tolerance and abs(expected[1] - found[1]) <= tolerance


#: Bytes of one tensor's checksum at the end of a bucket (two float64).
CHECKSUM_BYTES = 16


@attrs.frozen
class TransferPlan:
    """What both sides agree on once: the tensors in sending order, their buckets, and
    whether each bucket ends with the checksums of its tensors (see the module docstring)."""

    metas: tuple[ParamMeta, ...] = attrs.field(converter=tuple)
    buckets: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda b: tuple(tuple(x) for x in b))
    checksums: bool = False

    @classmethod
    def build(cls, metas: Sequence[ParamMeta], bucket_bytes: int, *, checksums: bool = False) -> TransferPlan:
        return cls(metas, bucket_layout(metas, bucket_bytes), checksums)

    @property
    def total_bytes(self) -> int:
        return sum(meta.nbytes for meta in self.metas)

    def offsets(self, bucket: int) -> list[int]:
        """Where each tensor of ``bucket`` starts in the bucket's buffer: packed in order, each
        at a multiple of :data:`ALIGN_BYTES` (so that it can be viewed as its dtype)."""
        out, end = [], 0
        for i in self.buckets[bucket]:
            start = -(-end // ALIGN_BYTES) * ALIGN_BYTES
            out.append(start)
            end = start + self.metas[i].nbytes
        return out

    def checksum_offset(self, bucket: int) -> int:
        """Where ``bucket``'s checksums start in its buffer: after its last tensor, aligned."""
        last = self.buckets[bucket][-1]
        end = self.offsets(bucket)[-1] + self.metas[last].nbytes
        return -(-end // ALIGN_BYTES) * ALIGN_BYTES

    def bucket_bytes(self, bucket: int) -> int:
        """The size of ``bucket``'s buffer (its tensors, their alignment padding and, with
        :attr:`checksums`, one :data:`CHECKSUM_BYTES` per tensor)."""
        if self.checksums:
            return self.checksum_offset(bucket) + CHECKSUM_BYTES * len(self.buckets[bucket])
        last = self.buckets[bucket][-1]
        return self.offsets(bucket)[-1] + self.metas[last].nbytes

    def bucket_checksums(self, bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        """The checksums region of ``bucket``'s ``buffer``: float64 [tensors, 2], a view."""
        start = self.checksum_offset(bucket)
        size = CHECKSUM_BYTES * len(self.buckets[bucket])
        return buffer[start : start + size].view(torch.float64).view(-1, 2)

    @property
    def staging_bytes(self) -> int:
        """The size of the largest bucket's buffer."""
        return max(self.bucket_bytes(b) for b in range(len(self.buckets)))

    def staging_buffer(self, device: torch.device) -> torch.Tensor:
        """One byte buffer of :attr:`staging_bytes`, touched once: every bucket of every sync
        reuses it (a fresh buffer per bucket costs a page fault per 4 KiB, which on a CPU
        takes longer than the copy itself)."""
        return torch.zeros(self.staging_bytes, dtype=torch.uint8, device=device)


@attrs.frozen
class TransferInit:
    """What an engine needs to join the sync group: the rendezvous address and port, its
    first rank in the group (``rank_offset``; an engine may hold several ranks, e.g. one per
    tensor-parallel worker), the group's size, the torch.distributed backend and the plan.
    With ``shared_memory`` (every engine on the sender's node, on the CPU), the buckets are
    not broadcast: rank 0 writes each into that shared-memory file, which the engines map,
    and the group carries only the signals (one copy in, one copy out, no socket). With
    ``cuda_ipc`` (every engine on rank 0's GPU), the same with rank 0's staging buffer on
    that GPU, mapped through its CUDA IPC handle (``torch.multiprocessing``'s
    ``reduce_tensor``: a rebuild function and its arguments), over a gloo group."""

    address: str
    port: int
    rank_offset: int
    world_size: int
    backend: str
    plan: TransferPlan
    timeout_s: float = DEFAULT_TIMEOUT_S
    shared_memory: str | None = None  # the shared-memory file of a same-node CPU sync
    cuda_ipc: tuple[Any, ...] | None = None  # the CUDA IPC handle of rank 0's staging buffer (same-GPU sync)

    def map_staging(self) -> torch.Tensor | None:
        """The staging buffer rank 0 shares (shared memory or CUDA IPC), mapped into this
        process; None when the buckets are broadcast."""
        if self.cuda_ipc is not None:
            rebuild, args = self.cuda_ipc
            return rebuild(*args)
        if self.shared_memory is not None:
            return map_shared(self.shared_memory, self.plan)
        return None


def host_store(address: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store, listening on a port the OS assigns (``store.port``): the
    port is known only once it is bound, so no other process can take it in between."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def receiving_key(sync: int, rank: int) -> str:
    """The key sync rank ``rank`` sets in the store when it starts receiving the ``sync``-th
    sync (counted from 1 on both sides)."""
    return f"posttrain-weight-sync-receiving/{sync}/{rank}"


def joined_key(rank: int) -> str:
    """The key sync rank ``rank`` sets in the store once it is ready to open the group."""
    return f"posttrain-weight-sync-joined/{rank}"


def open_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``world_size`` ranks for the sync only, meeting through ``store``
    (rank 0's :func:`host_store`, or a client of it); blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("posttrain-weight-sync", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"unknown weight-sync transport '{backend}'; expected gloo or nccl")


def _broadcast(group: Any, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([buffer], options).wait()


def _barrier(group: Any) -> None:
    group.barrier(dist.BarrierOptions()).wait()


def send_buckets(
    group: Any, plan: TransferPlan, tensors: Iterator[tuple[str, torch.Tensor]], staging: torch.Tensor, *, shared: bool
) -> None:
    """Send ``tensors`` (the plan's tensors, in its order) bucket by bucket from rank 0, each
    packed into the front of ``staging``. Broadcast: the bucket is broadcast. ``shared``:
    ``staging`` is a shared-memory mapping the engines read themselves; a one-byte broadcast
    says the bucket is ready and a barrier waits until they have taken it. Raises naming the
    first tensor that differs from the plan."""
    stream = iter(tensors)
    ready = torch.ones(1, dtype=torch.uint8)
    for index, bucket in enumerate(plan.buckets):
        buffer = staging[: plan.bucket_bytes(index)]
        for i, offset in zip(bucket, plan.offsets(index), strict=True):
            meta = plan.metas[i]
            name, tensor = next(stream, (None, None))
            if name != meta.name or tensor is None or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.torch_dtype:
                found = "nothing" if tensor is None else f"{name} {tensor.dtype} {tuple(tensor.shape)}"
                raise ValueError(f"weight sync: expected {meta.name} {meta.dtype} {meta.shape} (tensor {i}), got {found}")
            buffer[offset : offset + meta.nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
        if plan.checksums:
            sums = [checksum(buffer[o : o + plan.metas[i].nbytes].view(plan.metas[i].torch_dtype))
                    for i, o in zip(bucket, plan.offsets(index), strict=True)]
            plan.bucket_checksums(index, buffer).copy_(torch.tensor(sums, dtype=torch.float64))
        if shared:
            _settle(buffer)  # the copies are on the buffer before the engines are told
            _broadcast(group, ready)
            _barrier(group)
        else:
            _broadcast(group, buffer)


def receive_buckets(
    group: Any, plan: TransferPlan, staging: torch.Tensor | None, device: torch.device, *, shared: bool,
    own_buffers: bool = False,
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], list[tuple[float, float]]]]:
    """The plan's tensors as rank 0 sends them, one bucket at a time, with the checksums rank
    0 sent for them (empty without :attr:`TransferPlan.checksums`). With ``staging``: views
    into its front (load them before asking for the next bucket); without: each bucket in a
    buffer of its own on ``device``. ``shared``: ``staging`` is the shared-memory mapping
    rank 0 fills (required); the bucket is taken from it (copied into a buffer of its own
    with ``own_buffers``) and a barrier tells rank 0 it may refill it."""
    ready = torch.zeros(1, dtype=torch.uint8)
    for index, bucket in enumerate(plan.buckets):
        size = plan.bucket_bytes(index)
        if shared:
            assert staging is not None, "a shared-memory sync needs the mapping"
            _broadcast(group, ready)
            buffer = staging[:size].clone() if own_buffers else staging[:size]
        else:
            buffer = staging[:size] if staging is not None else torch.empty(size, dtype=torch.uint8, device=device)
            _broadcast(group, buffer)
        tensors = [
            (plan.metas[i].name, buffer[offset : offset + plan.metas[i].nbytes].view(plan.metas[i].torch_dtype)
             .view(plan.metas[i].shape))
            for i, offset in zip(bucket, plan.offsets(index), strict=True)
        ]
        sums = [tuple(row) for row in plan.bucket_checksums(index, buffer).tolist()] if plan.checksums else []
        yield tensors, sums
        if shared:
            _settle(buffer)  # the loader's reads of rank 0's buffer are done before it may refill it
            _barrier(group)


def _settle(buffer: torch.Tensor) -> None:
    """Wait for the work queued on ``buffer``'s CUDA device (nothing to wait for on the CPU):
    a signal about a shared buffer crosses processes, whose CUDA streams know nothing of it."""
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)


def create_shared(plan: TransferPlan) -> tuple[str, torch.Tensor]:
    """A new shared-memory file as large as the plan's largest bucket, and its mapping."""
    path = os.path.join(SHARED_MEMORY_DIR, f"posttrain-weights-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, plan.staging_bytes)
    finally:
        os.close(fd)
    return path, map_shared(path, plan)


def map_shared(path: str, plan: TransferPlan) -> torch.Tensor:
    """The shared-memory file ``path`` as a byte tensor (shared with every process mapping it)."""
    return torch.from_file(path, shared=True, size=plan.staging_bytes, dtype=torch.uint8)


def transport_device(backend: str) -> torch.device:
    """Where a transport's buffers live: the current CUDA device for nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class BroadcastReceiver:
    """One engine rank's end of the sync group: rank ``init.rank_offset + local_rank``.

    With checksums in the plan, :meth:`receive` checks every tensor that arrived against its
    sender's checksum and keeps the sender's in :attr:`sent_checksums` (name -> ``(sum, sum of
    absolute values)``, the last sync's).

    With ``reuse_staging`` every bucket is received into one buffer (the loader must copy
    each bucket's tensors before the next arrives); without it, each bucket gets a buffer of
    its own, for loaders that keep references to what they are given until later (vLLM's
    layerwise reload holds a layer's tensors until the whole layer has arrived)."""

    def __init__(self, init: TransferInit, local_rank: int = 0, *, reuse_staging: bool = True):
        self.plan = init.plan
        self.device = transport_device(init.backend)
        self.own_buffers = not reuse_staging
        self.staging: torch.Tensor | None = init.map_staging()
        self.shared = self.staging is not None
        if self.staging is None and reuse_staging:
            self.staging = init.plan.staging_buffer(self.device)
        self.sent_checksums: dict[str, tuple[float, float]] = {}
        self.rank = init.rank_offset + local_rank
        self.store = dist.TCPStore(init.address, init.port, init.world_size, is_master=False,
                                   timeout=datetime.timedelta(seconds=init.timeout_s))
        self.store.set(joined_key(self.rank), "")
        self.group = open_group(self.store, self.rank, init.world_size, init.backend, init.timeout_s)
        self.syncs = 0  # syncs received, to say which one this rank starts (receiving_key)

    def receive(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        """Receive one sync, passing each bucket's tensors to ``load`` (views into the
        bucket's buffer: copy what must outlive the call). When ``load`` raises, the rest of
        the sync is still received, so the sender is not left blocked, and the first error
        is raised after it. Tells the sender first that this rank is receiving (it waits for
        every rank before it broadcasts)."""
        self.syncs += 1
        self.store.set(receiving_key(self.syncs, self.rank), "")
        error: BaseException | None = None
        self.sent_checksums = {}
        garbled: list[str] = []
        buckets = receive_buckets(self.group, self.plan, self.staging, self.device, shared=self.shared,
                                  own_buffers=self.own_buffers)
        for bucket, sums in buckets:
            for (name, tensor), sent in zip(bucket, sums, strict=False):
                self.sent_checksums[name] = sent
                if not checksums_match(sent, checksum(tensor), torch.float64):
                    garbled.append(name)
            if error is None:
                try:
                    load(bucket)
                except Exception as exc:
                    error = exc
        if error is not None:
            raise error
        if garbled:
            raise WorkerError(f"weight sync: {len(garbled)} tensor(s) arrived with other values than policy rank 0 "
                              f"sent (checksums differ), e.g. {garbled[:5]}")


@attrs.frozen
class SendStats:
    """One sync, as rank 0 saw it: the transport (``gloo``, ``nccl``, ``shared memory`` or ``cuda ipc``),
    seconds, bytes and tensors sent, buckets, and the most bytes staged at once (one
    gathered layer group plus one bucket buffer)."""

    transport: str
    seconds: float
    bytes_sent: int
    num_tensors: int
    num_buckets: int
    peak_staging_bytes: int

    def refit_stats(self) -> RefitStats:
        return RefitStats(self.seconds, self.bytes_sent, self.num_tensors, self.num_buckets, self.peak_staging_bytes,
                          self.transport)


class GatheredWeights:
    """A policy rank's weights as the sync sends them: ``metadata`` (every exported tensor,
    on every rank) and :meth:`layers`, which gathers one layer group at a time with
    ``gather(names)`` (a collective: every rank must iterate) and yields the full tensors on
    rank 0 only, recording the largest group it held."""

    def __init__(self, metadata: Sequence[ParamMeta], gather: Callable[[list[str]], Mapping[str, torch.Tensor] | None]):
        self.groups = layer_groups([meta.name for meta in metadata])
        by_name = {meta.name: meta for meta in metadata}
        #: The tensors in the order :meth:`layers` yields them (layer group by layer group).
        self.metadata = [by_name[name] for group in self.groups for name in group]
        self.gather = gather
        self.peak_group_bytes = 0

    def gather_group(self, group: list[str]) -> Mapping[str, torch.Tensor] | None:
        """One layer group gathered (a collective): its full tensors on rank 0, None elsewhere."""
        full = self.gather(group)
        if full is not None:
            self.peak_group_bytes = max(self.peak_group_bytes, sum(t.numel() * t.element_size() for t in full.values()))
        return full

    def layers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in self.groups:
            full = self.gather_group(group)
            if full is None:
                continue
            for name in group:
                yield name, full[name]
            del full


@attrs.frozen
class BroadcastEndpoint:
    """The receiving side of a generation backend, as the policy's ranks need it: the
    engines' actor handles, how many ranks of the sync group each engine takes, the
    torch.distributed backend (``gloo``; ``nccl`` when the engines are on CUDA) and the
    engines' group name for messages. Picklable: it travels from the driver to the ranks.

    Every engine implements ``init_weight_transfer(init: TransferInit)`` and
    ``receive_weights(version: int) -> list[str]`` (the names of its model's parameters that
    the sync did not cover; see :class:`posttrain.backend.generation_group.EngineWorker`).
    """

    engines: tuple[Any, ...] = attrs.field(converter=tuple)
    ranks_per_engine: int
    backend: str
    name: str = "generation"
    timeout_s: float = DEFAULT_TIMEOUT_S
    refit_wait_s: float = DEFAULT_REFIT_WAIT_S
    engine_nodes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    shared_memory_on_one_node: bool = True
    checksums: bool = False  # generation.refit_checksums: each bucket carries its tensors' checksums

    def uses_shared_memory(self, node_id: str) -> bool:
        """Whether a sync from a sender on Ray node ``node_id`` goes through shared memory:
        gloo, allowed, and every engine known to be on that node."""
        return (self.backend == "gloo" and self.shared_memory_on_one_node and bool(self.engine_nodes)
                and all(node == node_id for node in self.engine_nodes))

    def connect(self, source: GatheredWeights, *, rank: int, bucket_bytes: int) -> WeightSender:
        """Called on every policy rank; rank 0 opens the group with the engines."""
        plan = TransferPlan.build(source.metadata, bucket_bytes, checksums=self.checksums)
        if rank != 0:
            return WeightSender(self, source, plan, group=None)
        import ray
        from torch.multiprocessing.reductions import reduce_tensor

        from posttrain.distributed.placement import this_process_devices

        address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        here = this_process_devices()
        world = 1 + len(self.engines) * self.ranks_per_engine
        store = host_store(address, world, self.timeout_s)
        port = store.port
        backend, transport, staging, shared_path, handle = self.backend, self.backend, None, None, None
        if self.backend == "nccl" and cuda_ipc_route(here, self._wait([e.devices.remote() for e in self.engines], "devices"),
                                                     self.ranks_per_engine, self.name):
            backend, transport = "gloo", "cuda ipc"
            staging = plan.staging_buffer(transport_device("nccl"))
            handle = reduce_tensor(staging)
        elif self.uses_shared_memory(here.node):
            transport = "shared memory"
            shared_path, staging = create_shared(plan)
        joining = [
            engine.init_weight_transfer.remote(
                TransferInit(address, port, 1 + i * self.ranks_per_engine, world, backend, plan, self.timeout_s,
                             shared_path, handle)
            )
            for i, engine in enumerate(self.engines)
        ]
        try:
            self._await_joined(store, joining, world)
        finally:
            if shared_path is not None:
                os.unlink(shared_path)  # the engines that joined have mapped it; nothing leaks if one fails
        group = open_group(store, 0, world, backend, self.timeout_s)
        self._wait(joining, "init_weight_transfer")
        return WeightSender(self, source, plan, group, staging, transport, store=store)

    def _await_joined(self, store: Any, joining: list[Any], world: int) -> None:
        """Wait until every engine rank has checked the plan and reached the rendezvous
        (:func:`joined_key`), raising meanwhile for an engine that refused the plan (names or
        shapes its model lacks: it never joins) or died, and after ``refit_wait_s`` (an engine
        busy with a generate call joins after it). Rank 0
        enters the group's rendezvous only then, so a failed connect leaves nothing blocked
        behind on this side."""
        import ray

        keys = [joined_key(rank) for rank in range(1, world)]
        deadline = time.monotonic() + self.refit_wait_s
        while not store.check(keys):
            done, _ = ray.wait(joining, num_returns=len(joining), timeout=0.05)
            failed = sorted((ref for ref in done if _raises(ref)), key=joining.index)  # the lowest engine named
            if failed:
                self._wait(failed, "init_weight_transfer", [joining.index(ref) for ref in failed])
            if time.monotonic() > deadline:
                missing = [rank for rank in range(1, world) if not store.check([joined_key(rank)])]
                raise WorkerError(f"weight sync: {self.name} rank(s) {missing} of the sync group did not join within "
                                  f"{self.refit_wait_s:g} s (generation.refit_wait_s)")

    def _wait(self, refs: list[Any], method: str, engines: Sequence[int] | None = None) -> list[Any]:
        """The engines' answers (``engines[k]`` is the index of the engine of ``refs[k]``);
        an engine that failed or died is named."""
        import ray

        results = []
        for k, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=self.timeout_s))
            except Exception as exc:  # RayActorError, RayTaskError, GetTimeoutError
                engine = engines[k] if engines is not None else k
                raise WorkerError(
                    f"weight sync: {self.name} engine {engine} {method}() failed: {_last_line(str(exc))}"
                ) from exc
        return results


def cuda_ipc_route(sender: DevicePlacement, engines: Sequence[DevicePlacement], ranks_per_engine: int, name: str) -> bool:
    """Whether an nccl sync from ``sender`` (policy rank 0) goes through CUDA IPC: every
    engine computes on the sender's GPU (colocated), where NCCL refuses to put two ranks of
    one group (``Duplicate GPU detected``). False when none does; raises when only some do,
    or when an engine on it has several ranks (tensor parallel), naming the fix."""
    sharing = [i for i, engine in enumerate(engines) if sender.shares_gpu_with(engine)]
    if not sharing:
        return False
    if len(sharing) == len(engines) and ranks_per_engine == 1:
        return True
    others = [i for i in range(len(engines)) if i not in sharing]
    why = f"engine(s) {others} do not" if others else f"each engine has {ranks_per_engine} ranks"
    raise WorkerError(
        f"weight sync to {name}: engine(s) {sharing} compute on GPU {list(sender.gpus)} of the policy's rank 0 and {why}; "
        "NCCL cannot hold two ranks of one group on one GPU, and the CUDA IPC path needs every engine on that GPU "
        "with one rank. Set generation.weight_transport: gloo (the weights then pass through CPU memory), or give "
        "the engines GPUs of their own (generation.colocated: false)"
    )


def _raises(ref: Any) -> bool:
    """Whether a finished Ray call raised."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False


class WeightSender:
    """One policy rank's end of a connected sync (see the module docstring)."""

    def __init__(self, endpoint: BroadcastEndpoint, source: GatheredWeights, plan: TransferPlan, group: Any,
                 shared: torch.Tensor | None = None, transport: str = "", *, store: Any = None):
        """``shared``: the staging buffer the engines map (shared memory or CUDA IPC), which
        ``transport`` names; without it the buckets are broadcast over ``group``. ``store``:
        the group's rendezvous store (rank 0), where the engines say they are receiving."""
        self.endpoint = endpoint
        self.store = store
        self.syncs = 0
        self.source = source
        self.plan = plan
        self.group = group
        self.shared = shared is not None
        self.transport = transport or endpoint.backend
        if shared is not None:
            self.staging: torch.Tensor | None = shared
        else:
            self.staging = plan.staging_buffer(transport_device(endpoint.backend)) if group is not None else None

    def send(self, version: int) -> SendStats | None:
        """Sync the weights under ``version``; every rank calls it (the gathers are
        collectives). Rank 0 returns what it sent, the others None. Buckets are staged on
        the CPU for gloo, on the current CUDA device for nccl."""
        start = time.perf_counter()
        if self.group is None:
            for _ in self.source.layers():
                pass
            return None
        receiving = [engine.receive_weights.remote(version) for engine in self.endpoint.engines]
        self.syncs += 1
        self._await_receiving(receiving)
        try:
            send_buckets(self.group, self.plan, self.source.layers(), self.staging, shared=self.shared)
        except Exception as exc:
            self._raise_for_dead_engine(receiving)
            raise WorkerError(f"weight sync to {self.endpoint.name}: the broadcast failed: {_last_line(str(exc))}") from exc
        uncovered = self.endpoint._wait(receiving, "receive_weights")
        for i, names in enumerate(uncovered):
            if names:
                raise WorkerError(
                    f"weight sync: {len(names)} parameter(s) of {self.endpoint.name} engine {i}'s model received "
                    f"nothing, e.g. {names[:5]}; the policy exports {[m.name for m in self.plan.metas[:5]]}... "
                    "(the two models' parameter names must match)"
                )
        return SendStats(
            transport=self.transport,
            seconds=time.perf_counter() - start,
            bytes_sent=self.plan.total_bytes,
            num_tensors=len(self.plan.metas),
            num_buckets=len(self.plan.buckets),
            peak_staging_bytes=self.source.peak_group_bytes + self.plan.staging_bytes,
        )

    def _await_receiving(self, receiving: list[Any]) -> None:
        """Wait until every engine rank started receiving this sync (an engine busy with a
        generate call takes it after), at most ``refit_wait_s``; raise for an engine whose
        ``receive_weights`` failed meanwhile, and at the deadline, naming the ranks."""
        import ray

        world = 1 + len(self.endpoint.engines) * self.endpoint.ranks_per_engine
        keys = [receiving_key(self.syncs, rank) for rank in range(1, world)]
        deadline = time.monotonic() + self.endpoint.refit_wait_s
        while not self.store.check(keys):
            done, _ = ray.wait(receiving, num_returns=len(receiving), timeout=0.05)
            if done:
                self._raise_for_dead_engine(receiving)
            if time.monotonic() > deadline:
                missing = [rank for rank in range(1, world) if not self.store.check([receiving_key(self.syncs, rank)])]
                raise WorkerError(
                    f"weight sync to {self.endpoint.name}: rank(s) {missing} of the sync group did not start receiving "
                    f"within {self.endpoint.refit_wait_s:g} s (generation.refit_wait_s): their engine is still busy, "
                    "e.g. with a long generate call. Raise generation.refit_wait_s, or shorten the calls "
                    "(generation.max_new_tokens, smaller batches)."
                )

    def _raise_for_dead_engine(self, refs: list[Any]) -> None:
        import ray

        from posttrain.distributed.worker_group import actor_died

        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for i, ref in enumerate(refs):
            if ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    raise (ProcessDied if actor_died(exc) else WorkerError)(
                        f"weight sync: {self.endpoint.name} engine {i} failed while receiving: {_last_line(str(exc))}"
                    ) from exc


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
