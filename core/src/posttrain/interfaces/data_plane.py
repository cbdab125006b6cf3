"""Data planes: where a step's per-sample fields live between driver and workers.

Samples are addressed by string keys inside a partition (one per step, e.g. ``"train/7"``;
validation uses its own). Tags are small per-row scalars the driver may read without
fetching any tensor field (e.g. ``keep`` for dynamic sampling, ``length``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

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

    def shutdown(self) -> None:
        """Release the plane's processes and memory."""
