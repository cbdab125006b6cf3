"""The in-memory data plane: core's default, a dict per partition in the driver process.

Workers cannot reach it (:meth:`~posttrain.interfaces.DataPlane.worker_handle` is None), so
policy passes over its samples are read and written by the driver, which sends each worker
its shard's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.batch import Batch
from posttrain.interfaces.data_plane import DataPlane


class MemoryDataPlane(DataPlane):
    """Keeps every field of every sample in driver memory, keyed by partition and sample."""

    def __init__(self) -> None:
        # partition -> key -> field -> per-sample value (tensor row or Python object)
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}
        self._tags: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def put(self, partition: str, keys: Sequence[str], fields: Mapping[str, Any], tags: Mapping[str, torch.Tensor] | None = None) -> None:
        rows = self._rows.setdefault(partition, {})
        row_tags = self._tags.setdefault(partition, {})
        for name, value in {**fields, **(tags or {})}.items():
            if len(value) != len(keys):
                raise ValueError(f"data plane put: field '{name}' has {len(value)} rows for {len(keys)} keys")
        for i, key in enumerate(keys):
            row = rows.setdefault(key, {})
            for name, value in fields.items():
                row[name] = value[i]
            for name, value in (tags or {}).items():
                row_tags.setdefault(key, {})[name] = value[i]

    def get(self, partition: str, keys: Sequence[str], fields: Sequence[str]) -> Batch:
        rows = self._partition(partition)
        samples = []
        for key in keys:
            if key not in rows:
                raise KeyError(f"data plane partition '{partition}' has no sample '{key}'")
            missing = [f for f in fields if f not in rows[key]]
            if missing:
                raise KeyError(f"data plane sample '{key}' in '{partition}' has no field(s) {missing}; has {sorted(rows[key])}")
            samples.append({f: rows[key][f] for f in fields})
        return Batch.from_samples(samples)

    def tags(self, partition: str, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        self._partition(partition)
        tags = self._tags.get(partition, {})
        keys = list(self.keys(partition)) if keys is None else list(keys)
        names = sorted({n for k in keys for n in tags.get(k, {})})
        return {n: torch.stack([torch.as_tensor(tags[k][n]) for k in keys]) for n in names}

    def keys(self, partition: str) -> list[str]:
        return list(self._partition(partition))

    def clear(self, partition: str) -> None:
        self._rows.pop(partition, None)
        self._tags.pop(partition, None)

    def partitions(self) -> list[str]:
        return list(self._rows)

    def _partition(self, partition: str) -> dict[str, dict[str, Any]]:
        try:
            return self._rows[partition]
        except KeyError:
            raise KeyError(f"data plane has no partition '{partition}'; partitions: {self.partitions()}") from None

