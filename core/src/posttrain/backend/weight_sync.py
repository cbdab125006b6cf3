"""Weight sync, worker to worker: the policy's ranks broadcast their weights straight to the
generation engines; the driver only tells them when (and under which version).

Setup, once per pair of policy and generation backend: the driver hands every policy rank
the generation backend's :class:`BroadcastEndpoint` (actor handles and the transport to use,
no tensors). Policy rank 0 opens a rendezvous store on a free port of its node and, through
the engines' own actor handles, asks every engine to join a process group with it
(:meth:`EngineWorker.init_weight_transfer`), telling them, once, the parameters' names,
shapes and dtypes and how they are cut into buckets (:class:`TransferPlan`).

Each sync: the driver calls ``send_weights(version)`` on every policy rank. Rank 0 asks every
engine to receive (``receive_weights(version)``, an actor call of its own) and broadcasts
the weights: the ranks gather one layer group at a time (:func:`layer_groups`, a collective
of the backend's ``gather_weights``), rank 0 packs the full tensors into buckets of at most
``generation.refit_bucket_bytes`` and broadcasts each bucket as one flat byte buffer; the
engines cut the same buffer back into tensors (both sides derive the cuts from the plan)
and load them. At most one layer group and one bucket are staged on rank 0.

The transport is a torch.distributed process group made for the sync only (a
``TCPStore`` rendezvous and a ``ProcessGroupGloo``, or ``ProcessGroupNCCL`` on CUDA), so it
coexists with whatever groups the trainer and the engines already run.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from posttrain.backend.hf_export import bucket_names
from posttrain.errors import WorkerError

#: Seconds a broadcast, or joining the group, may wait for a peer before failing.
DEFAULT_TIMEOUT_S = 120.0
#: Each tensor starts at a multiple of this many bytes in a bucket's buffer.
ALIGN_BYTES = 16


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


@attrs.frozen
class TransferPlan:
    """What both sides agree on once: the tensors in sending order and their buckets."""

    metas: tuple[ParamMeta, ...] = attrs.field(converter=tuple)
    buckets: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda b: tuple(tuple(x) for x in b))

    @classmethod
    def build(cls, metas: Sequence[ParamMeta], bucket_bytes: int) -> TransferPlan:
        return cls(metas, bucket_layout(metas, bucket_bytes))

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

    def bucket_bytes(self, bucket: int) -> int:
        """The size of ``bucket``'s buffer (its tensors and their alignment padding)."""
        last = self.buckets[bucket][-1]
        return self.offsets(bucket)[-1] + self.metas[last].nbytes


@attrs.frozen
class TransferInit:
    """What an engine needs to join the sync group: the rendezvous address and port, its
    first rank in the group (``rank_offset``; an engine may hold several ranks, e.g. one per
    tensor-parallel worker), the group's size, the torch.distributed backend and the plan."""

    address: str
    port: int
    rank_offset: int
    world_size: int
    backend: str
    plan: TransferPlan
    timeout_s: float = DEFAULT_TIMEOUT_S


def open_group(address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``world_size`` ranks for the sync only (rank 0 hosts the store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
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


def send_buckets(group: Any, plan: TransferPlan, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> int:
    """Broadcast ``tensors`` (the plan's tensors, in its order) bucket by bucket from rank 0;
    return the most bytes held in one bucket buffer. Raises naming the first tensor that
    differs from the plan."""
    peak = 0
    stream = iter(tensors)
    for index, bucket in enumerate(plan.buckets):
        size = plan.bucket_bytes(index)
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        for i, offset in zip(bucket, plan.offsets(index), strict=True):
            meta = plan.metas[i]
            name, tensor = next(stream, (None, None))
            if name != meta.name or tensor is None or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.torch_dtype:
                found = "nothing" if tensor is None else f"{name} {tensor.dtype} {tuple(tensor.shape)}"
                raise ValueError(f"weight sync: expected {meta.name} {meta.dtype} {meta.shape} (tensor {i}), got {found}")
            buffer[offset : offset + meta.nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
        _broadcast(group, buffer)
        peak = max(peak, size)
        del buffer
    return peak


def receive_buckets(group: Any, plan: TransferPlan, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The plan's tensors as broadcast by rank 0, one bucket at a time (views into the
    bucket's buffer: load them before asking for the next bucket)."""
    for index, bucket in enumerate(plan.buckets):
        buffer = torch.empty(plan.bucket_bytes(index), dtype=torch.uint8, device=device)
        _broadcast(group, buffer)
        yield [
            (plan.metas[i].name, buffer[offset : offset + plan.metas[i].nbytes].view(plan.metas[i].torch_dtype)
             .view(plan.metas[i].shape))
            for i, offset in zip(bucket, plan.offsets(index), strict=True)
        ]


def transport_device(backend: str) -> torch.device:
    """Where a transport's buffers live: the current CUDA device for nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class BroadcastReceiver:
    """One engine rank's end of the sync group: rank ``init.rank_offset + local_rank``."""

    def __init__(self, init: TransferInit, local_rank: int = 0):
        self.plan = init.plan
        self.device = transport_device(init.backend)
        self.group = open_group(init.address, init.port, init.rank_offset + local_rank, init.world_size, init.backend,
                                init.timeout_s)

    def receive(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        """Receive one sync, passing each bucket's tensors to ``load`` (views into the
        bucket's buffer: copy what must outlive the call). When ``load`` raises, the rest of
        the sync is still received, so the sender is not left blocked, and the first error
        is raised after it."""
        error: BaseException | None = None
        for bucket in receive_buckets(self.group, self.plan, self.device):
            if error is None:
                try:
                    load(bucket)
                except Exception as exc:
                    error = exc
        if error is not None:
            raise error


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


@attrs.frozen
class SendStats:
    """One sync, as rank 0 saw it: seconds, bytes and tensors sent, buckets, and the most
    bytes staged at once (one gathered layer group plus one bucket buffer)."""

    seconds: float
    bytes_sent: int
    num_tensors: int
    num_buckets: int
    peak_staging_bytes: int


class GatheredWeights:
    """A policy rank's weights as the sync sends them: ``metadata`` (every exported tensor,
    on every rank) and :meth:`layers`, which gathers one layer group at a time with
    ``gather(names)`` (a collective: every rank must iterate) and yields the full tensors on
    rank 0 only, recording the largest group it held."""

    def __init__(self, metadata: Sequence[ParamMeta], gather: Callable[[list[str]], Mapping[str, torch.Tensor] | None]):
        self.metadata = list(metadata)
        self.gather = gather
        self.peak_group_bytes = 0

    def layers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in layer_groups([meta.name for meta in self.metadata]):
            full = self.gather(group)
            if full is None:
                continue
            self.peak_group_bytes = max(self.peak_group_bytes, sum(t.numel() * t.element_size() for t in full.values()))
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

    def connect(self, source: GatheredWeights, *, rank: int, bucket_bytes: int) -> WeightSender:
        """Called on every policy rank; rank 0 opens the group with the engines."""
        plan = TransferPlan.build(source.metadata, bucket_bytes)
        if rank != 0:
            return WeightSender(self, source, plan, group=None)
        import ray

        address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        port = free_port()
        world = 1 + len(self.engines) * self.ranks_per_engine
        joining = [
            engine.init_weight_transfer.remote(
                TransferInit(address, port, 1 + i * self.ranks_per_engine, world, self.backend, plan, self.timeout_s)
            )
            for i, engine in enumerate(self.engines)
        ]
        # The engines join while rank 0 waits in the rendezvous; an engine that refuses the
        # plan (names or shapes its model lacks) never joins, so its answer is watched meanwhile.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            opening = pool.submit(open_group, address, port, 0, world, self.backend, self.timeout_s)
            while True:
                try:
                    group = opening.result(timeout=0.2)
                    break
                except concurrent.futures.TimeoutError:
                    done, _ = ray.wait(joining, num_returns=len(joining), timeout=0)
                    failed = [ref for ref in done if _raises(ref)]
                    if failed:
                        self._wait(failed, "init_weight_transfer", [joining.index(ref) for ref in failed])
        finally:
            pool.shutdown(wait=False)
        self._wait(joining, "init_weight_transfer")
        return WeightSender(self, source, plan, group)

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

    def __init__(self, endpoint: BroadcastEndpoint, source: GatheredWeights, plan: TransferPlan, group: Any):
        self.endpoint = endpoint
        self.source = source
        self.plan = plan
        self.group = group

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
        try:
            peak_bucket = send_buckets(self.group, self.plan, self.source.layers(), transport_device(self.endpoint.backend))
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
            seconds=time.perf_counter() - start,
            bytes_sent=self.plan.total_bytes,
            num_tensors=len(self.plan.metas),
            num_buckets=len(self.plan.buckets),
            peak_staging_bytes=self.source.peak_group_bytes + peak_bucket,
        )

    def _raise_for_dead_engine(self, refs: list[Any]) -> None:
        import ray

        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for i, ref in enumerate(refs):
            if ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    raise WorkerError(
                        f"weight sync: {self.endpoint.name} engine {i} failed while receiving: {_last_line(str(exc))}"
                    ) from exc


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
