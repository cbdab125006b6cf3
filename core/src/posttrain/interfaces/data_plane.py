"""Data planes: where a step's per-sample fields live between driver and workers.

Samples are addressed by string keys inside a partition (one per step, e.g. ``"train/7"``;
validation uses its own). Tags are small per-row scalars the driver may read without
fetching any tensor field (e.g. ``keep`` for dynamic sampling, ``length``).

An algorithm hands a policy pass a :class:`PlaneSamples` (which keys of which partition, read
as which fields) instead of a materialised batch. A plane that other processes of the Ray
cluster can reach says so through :meth:`DataPlane.worker_handle`; a sharded policy then lets
each worker fetch its own shard and store its results, so the driver holds only keys and
lengths. A plane living in the driver's memory returns None, and the policy reads and writes
through the driver instead. Algorithms never see which of the two happened.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from posttrain.batch import Batch


class DataPlane(abc.ABC):
    """Keyed per-sample storage, partitioned by step."""

    @abc.abstractmethod
    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Mapping[str, Any],
        tags: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Write ``fields`` (tensors with first dim len(keys), or per-sample lists) for
        ``keys``. A field written again for the same key replaces the old value."""

    @abc.abstractmethod
    def get(self, partition: str, keys: Sequence[str], fields: Sequence[str]) -> Batch:
        """Read the selected fields for the selected keys, in the order of ``keys``."""

    @abc.abstractmethod
    def tags(self, partition: str, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Read the tags of ``keys`` (all keys of the partition when None) without
        touching tensor fields."""

    @abc.abstractmethod
    def keys(self, partition: str) -> list[str]:
        """Keys in insertion order."""

    @abc.abstractmethod
    def clear(self, partition: str) -> None:
        """Drop a partition and everything in it. Clearing a missing partition is a no-op."""

    @abc.abstractmethod
    def partitions(self) -> list[str]:
        """Partitions that currently hold data."""

    def worker_handle(self) -> WorkerPlaneHandle | None:
        """A picklable handle that opens this plane's data from another process of the Ray
        cluster (a policy worker), or None when only this process can reach it (the
        default: then policies read and write through this object in the driver)."""
        return None

    def shutdown(self) -> None:
        """Release the plane's processes and memory."""


class WorkerPlaneHandle(abc.ABC):
    """What a worker process needs to reach a driver's plane; sent to workers with their work."""

    @abc.abstractmethod
    def open(self) -> DataPlane:
        """The plane, as seen from the calling process (opened once per process and reused).
        It reads and writes the driver's partitions and never clears or stops them."""


@attrs.frozen
class PlaneSamples:
    """Samples ``keys`` of ``partition`` in ``plane``, read as ``fields``: the input of a
    policy pass that reads its data from a plane (see :meth:`posttrain.interfaces.Policy.train_from`)."""

    plane: DataPlane
    partition: str
    keys: tuple[str, ...] = attrs.field(converter=tuple)
    fields: tuple[str, ...] = attrs.field(converter=tuple)

    def __len__(self) -> int:
        return len(self.keys)

    def get(self) -> Batch:
        """The samples' fields, materialised in this process."""
        return self.plane.get(self.partition, self.keys, self.fields)

    def put(self, fields: Mapping[str, Any]) -> None:
        """Write ``fields`` (first dimension ``len(self)``) for these samples."""
        self.plane.put(self.partition, self.keys, fields)

    def chunks(self, size: int) -> list[PlaneSamples]:
        """Consecutive runs of ``size`` keys (the last may be shorter), in order."""
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        return [attrs.evolve(self, keys=self.keys[start:start + size]) for start in range(0, len(self.keys), size)]


class SampleMap(Protocol):
    """A per-sample computation on plane samples, run next to the data by
    :meth:`posttrain.interfaces.Policy.map_into`.

    Called on a :class:`~posttrain.batch.Batch` holding some of the samples (any subset, in
    any order: each worker maps its own shard), it returns the fields to write for those
    samples (first dimension the batch's) and sums over them that add up over any split of
    the samples (counts and totals, from which the caller forms means). A sample's fields
    must depend on that sample's rows alone. It is pickled to the workers: make it a
    module-level class or function.
    """

    def __call__(self, batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]: ...
