"""Engines hosted in the policy's own worker processes (``generation.in_policy_workers``).

A generation backend whose section declares ``runs_in_policy_workers`` can run its engines
inside the processes of the policy's ranks instead of processes of their own: one engine
per rank, built there by :class:`HostedGroup` (through the ranks' generic
:meth:`~posttrain.distributed.Worker.run_work`) and kept in this module's per-process
registry under the group's name. A refit (:class:`HostedEndpoint`) gathers the policy's
weights one layer group at a time, as a worker-to-worker sync does, and hands them to the
engine of the same process, which may keep them rather than copy them
(:meth:`~posttrain.backend.engine.EngineWorker.share_weights`: one copy of the weights in the
process); ranks other than 0 receive each tensor from rank 0 by a broadcast over the
policy's own process group, the one its gathers use. What this saves is
the engines' processes (their imports, their runtime, their copy of the framework) and the
sync group with them; what it costs is that generation and training take turns in one
process, so it is synchronous only (``generation.colocated``).

The engine classes are the same :class:`~posttrain.backend.engine.EngineWorker`
classes as in a group of their own; a hosted one also implements ``check_weights`` and
``load_weights``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from posttrain.backend.weight_sync import GatheredWeights, SendStats, transport_device
from posttrain.distributed.worker_group import Worker, WorkerGroup, bound_method
from posttrain.errors import WorkerError

if TYPE_CHECKING:
    from posttrain.backend.engine import EngineWorker

#: This process's hosted engines, by group name.
_HOSTED: dict[str, Any] = {}


def hosted_engine(name: str) -> EngineWorker:
    """The engine hosted in this process under ``name``."""
    engine = _HOSTED.get(name)
    if engine is None:
        raise WorkerError(
            f"no '{name}' engine is hosted in this process (pid-local registry: {sorted(_HOSTED) or 'empty'}); "
            "the generation backend was shut down or never started here"
        )
    return engine


def host_engine(name: str, engine_cls: type, kwargs: Mapping[str, Any]) -> None:
    """Build ``engine_cls(**kwargs)`` in this process and keep it under ``name``."""
    _HOSTED[name] = engine_cls(**kwargs)


def drop_engine(name: str) -> None:
    """Forget the engine hosted under ``name`` (nothing when there is none)."""
    _HOSTED.pop(name, None)


@attrs.frozen
class InThisProcess:
    """A work item for :meth:`Worker.run_work` that calls a module function (given as the
    method) in the worker's process."""

    def run(self, worker: Worker, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


@attrs.frozen
class OnHosted:
    """A work item for :meth:`Worker.run_work`: call an engine method (the engine's own
    override of it) on the engine hosted under ``name``, with ``args`` first."""

    name: str
    args: tuple[Any, ...] = ()

    def run(self, worker: Worker, method: Callable[..., Any], *args: Any) -> Any:
        return bound_method(hosted_engine(self.name), method)(*self.args, *args)


class HostedGroup:
    """Engines of ``engine_cls`` (built with ``kwargs``) hosted in every rank of ``group``, the
    policy's worker group, under ``name``; the calls a
    :class:`~posttrain.backend.generation_group.WorkerGroupGeneration` makes of its engines:
    ``run_all`` and ``run_sharded`` name an engine method, as on a :class:`WorkerGroup`."""

    def __init__(self, group: WorkerGroup[Any], name: str, engine_cls: type, kwargs: Mapping[str, Any]):
        self.group = group
        self.name = name
        self.world_size = group.world_size
        self.node_ids = group.node_ids
        group.run_all(Worker.run_work, InThisProcess(), host_engine, name, engine_cls, dict(kwargs))

    def run_all(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        return self.group.run_all(Worker.run_work, OnHosted(self.name), method, *args)

    def run_sharded(self, method: Callable[..., Any], shards: Sequence[Any]) -> list[Any]:
        return self.group.run_sharded(Worker.run_work, [OnHosted(self.name, (shard,)) for shard in shards], method)

    def shutdown(self) -> None:
        """Drop the engines (the policy's processes stay). Safe to call twice, and after the
        policy's group was shut down (then there is nothing to drop)."""
        if self.group.closed:
            return
        try:
            self.group.run_all(Worker.run_work, InThisProcess(), drop_engine, self.name)
        except WorkerError:
            pass  # a rank that died took its engine with it


@attrs.frozen
class HostedEndpoint:
    """The weight endpoint of engines hosted under ``name`` in the policy's own ranks: each
    rank loads the weights into the engine of its own process."""

    name: str

    def connect(self, source: GatheredWeights, *, rank: int, bucket_bytes: int) -> HostedSender:
        """Called on every policy rank: check the weights against this rank's engine."""
        engine = hosted_engine(self.name)
        engine.check_weights(source.metadata)
        return HostedSender(engine, source, rank)


class HostedSender:
    """One policy rank's end of an in-process sync (``bucket_bytes`` plays no part: a layer
    group at a time is loaded straight from the gathered tensors)."""

    def __init__(self, engine: EngineWorker, source: GatheredWeights, rank: int):
        self.engine = engine
        self.source = source
        self.rank = rank
        self.metas = {meta.name: meta for meta in source.metadata}

    def send(self, version: int) -> SendStats | None:
        """Load the current weights into this rank's engine under ``version`` (every rank
        calls it: the gathers are collectives); rank 0 returns what moved."""
        start = time.perf_counter()
        self.engine.wake_up()
        for group in self.source.groups:
            full = self.source.gather_group(group)
            self.engine.share_weights([(name, self._tensor(name, full)) for name in group])
        self.engine.weight_version = version
        if self.rank != 0:
            return None
        return SendStats(
            transport="in process",
            seconds=time.perf_counter() - start,
            bytes_sent=sum(meta.nbytes for meta in self.metas.values()),
            num_tensors=len(self.metas),
            num_buckets=len(self.source.groups),
            peak_staging_bytes=self.source.peak_group_bytes,
        )

    def _tensor(self, name: str, full: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        """``name``'s full tensor: rank 0 gathered it; the other ranks receive it from rank 0
        over the policy's process group."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            assert full is not None, "a single rank gathers every weight"
            return full[name]
        device = transport_device(dist.get_backend())
        if full is not None:
            tensor = full[name].detach().to(device).contiguous()
        else:
            meta = self.metas[name]
            tensor = torch.empty(meta.shape, dtype=meta.torch_dtype, device=device)
        dist.broadcast(tensor, src=0)
        return tensor
