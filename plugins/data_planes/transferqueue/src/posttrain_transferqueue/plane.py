"""The ``transferqueue`` data plane: samples live in TransferQueue storage actors.

The driver holds no sample data: keys and tags live in TransferQueue's controller (tags are
its per-sample ``custom_meta``, read with ``kv_list`` without touching storage), tensor and
Python-object fields in its storage units. A get asks the storage units for exactly the
selected keys and fields, so reading the ``keep`` tag and getting the kept keys never moves
a dropped sample's tensors.

Policy workers reach the driver's partitions through :class:`TransferQueueHandle` (the
plane's :meth:`~TransferQueueDataPlane.worker_handle`): each fetches its own shard and writes
its logprobs back, so those tensors never pass through the driver.

Partitions are stored as ``"<namespace>:<partition>"``. The namespace defaults to one
derived from the run directory: runs sharing a Ray cluster stay apart, and a plane created
with ``exclusive=True`` (the run's driver) clears what an earlier crashed process of the same
run left in its namespace before the first step.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from posttrain.batch import Batch
from posttrain.errors import WorkerError
from posttrain.interfaces.data_plane import DataPlane, WorkerPlaneHandle
from posttrain.log import get_logger
from posttrain_transferqueue import codec, runtime
from posttrain_transferqueue.config import SECTION, TransferQueueConfig

_log = get_logger(__name__)


def run_namespace(run_dir: str) -> str:
    """The default partition namespace of the run writing to ``run_dir``."""
    return "posttrain-" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]


class TransferQueueDataPlane(DataPlane):
    """A :class:`DataPlane` over TransferQueue's key-value API.

    Creating it starts TransferQueue in the connected Ray cluster, or attaches to the running
    one (a Ray worker creating a plane with the driver's ``namespace`` and
    ``exclusive=False`` reads the driver's partitions). ``exclusive`` marks the namespace's
    only writer (the run's driver): it clears the namespace's leftover partitions when
    created, and its own partitions at :meth:`shutdown`. ``joined``: the address of the Ray
    cluster the run joined, None when it started Ray (for what a failed start suggests).
    """

    def __init__(self, options: TransferQueueConfig, namespace: str, *, exclusive: bool = True, joined: str | None = None):
        import transfer_queue as tq

        self.options = options
        self.namespace = namespace
        self.exclusive = exclusive
        self._prefix = f"{namespace}:"
        self._started = runtime.connect(options, joined)
        self._client = tq.get_client()
        runtime.watch_actors(self._client, options)
        # partition -> field -> kind: TransferQueue fixes a field's dtype within a partition.
        self._kinds: dict[str, dict[str, str]] = {}
        self._closed = False
        if exclusive:
            stale = self.partitions()
            for partition in stale:
                self.clear(partition)
            if stale:
                _log.warning("cleared partitions left by an earlier process", namespace=namespace, partitions=stale)

    # ------------------------------------------------------------------ DataPlane

    def put(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Mapping[str, Any],
        tags: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        keys, tags = list(keys), dict(tags or {})
        for name, value in {**fields, **tags}.items():
            if len(value) != len(keys):
                raise ValueError(f"data plane put: field '{name}' has {len(value)} rows for {len(keys)} keys")
        if not keys:
            return
        self._check_kinds(partition, fields)
        meta = self._client.kv_retrieve_meta(keys=keys, partition_id=self._qualified(partition), create=True)
        codec.encode_tags(tags, meta.custom_meta)
        if fields:
            self._write(partition, codec.encode(fields, len(keys)), meta)  # also writes the tags
        elif tags:
            self._client.set_custom_meta(meta)
        kinds = self._kinds.setdefault(partition, {})
        kinds.update({name: codec.field_kind(value) for name, value in fields.items()})

    def get(self, partition: str, keys: Sequence[str], fields: Sequence[str]) -> Batch:
        keys, fields = list(keys), list(fields)
        if not keys:
            self._listing(partition)  # a missing partition still raises
            return Batch()
        meta = self._client.kv_retrieve_meta(keys=keys, partition_id=self._qualified(partition), create=False)
        if meta.size != len(keys):
            listing = self._listing(partition)
            missing = [key for key in keys if key not in listing]
            raise KeyError(f"data plane partition '{partition}' has no sample(s) {_names(missing)}")
        absent = [name for name in fields if name not in meta.field_names]
        if absent:
            raise KeyError(self._missing_fields_message(partition, keys, absent))
        if not fields:
            return Batch()
        columns = self._client.get_data(meta.select_fields(fields))
        return Batch({name: codec.decode(name, columns[name]) for name in fields})

    def tags(self, partition: str, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        listing = self._listing(partition)
        keys = list(listing) if keys is None else list(keys)
        missing = [key for key in keys if key not in listing]
        if missing:
            raise KeyError(f"data plane partition '{partition}' has no sample(s) {_names(missing)}")
        return codec.decode_tags([listing[key] for key in keys])

    def keys(self, partition: str) -> list[str]:
        return list(self._listing(partition))

    def clear(self, partition: str) -> None:
        qualified = self._qualified(partition)
        if qualified in self._client.get_partition_list():
            self._client.clear_partition(qualified)
        self._kinds.pop(partition, None)

    def partitions(self) -> list[str]:
        listing = self._client.kv_list()
        return [
            name.removeprefix(self._prefix) for name, rows in listing.items() if name.startswith(self._prefix) and rows
        ]

    def worker_handle(self) -> TransferQueueHandle:
        return TransferQueueHandle(self.options, self.namespace)

    def shutdown(self) -> None:
        """Stop TransferQueue when this plane started it (every sample in it goes); otherwise
        clear this plane's partitions when it is ``exclusive``, and leave TransferQueue up."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            runtime.stop()
        elif self.exclusive:
            for partition in self.partitions():
                self.clear(partition)

    # ------------------------------------------------------------------ helpers

    def _qualified(self, partition: str) -> str:
        return self._prefix + partition

    def _listing(self, partition: str) -> dict[str, dict[str, Any]]:
        """Keys (in insertion order) and their tags, from TransferQueue's controller."""
        rows = self._client.kv_list(partition_id=self._qualified(partition)).get(self._qualified(partition))
        if not rows:
            raise KeyError(f"data plane has no partition '{partition}'; partitions: {self.partitions()}")
        return rows

    def _write(self, partition: str, columns: Any, meta: Any) -> None:
        try:
            self._client.put(columns, meta)
        except RuntimeError as error:
            hint = ""
            if "capacity exceeded" in str(error):
                hint = (
                    f" TransferQueue holds at most {SECTION}.storage_capacity={self.options.storage_capacity} samples:"
                    " raise it or clear finished partitions sooner."
                )
            raise WorkerError(
                f"data plane put of {meta.size} samples into '{partition}' failed: {error}.{hint}"
            ) from error

    def _check_kinds(self, partition: str, fields: Mapping[str, Any]) -> None:
        known = self._kinds.get(partition, {})
        for name, value in fields.items():
            kind = codec.field_kind(value)
            if known.get(name, kind) != kind:
                raise TypeError(
                    f"data plane put: field '{name}' of partition '{partition}' holds {known[name]}, got {kind}. "
                    "TransferQueue keeps one dtype per field within a partition: cast the value or use a new field name"
                )

    def _missing_fields_message(self, partition: str, keys: list[str], absent: list[str]) -> str:
        """Name the first key lacking a field (one controller query per key, error path only)."""
        qualified = self._qualified(partition)
        for key in keys:
            has = self._client.kv_retrieve_meta(keys=[key], partition_id=qualified, create=False).field_names
            missing = [name for name in absent if name not in has]
            if missing:
                return f"data plane sample '{key}' in '{partition}' has no field(s) {missing}; has {sorted(has)}"
        return f"data plane partition '{partition}': fields {absent} are not written for all of {_names(keys)}"


#: Planes opened by :meth:`TransferQueueHandle.open` in this process, by namespace.
_opened: dict[str, TransferQueueDataPlane] = {}


@attrs.frozen
class TransferQueueHandle(WorkerPlaneHandle):
    """Opens a driver's TransferQueue partitions (``namespace``) from another process of its
    Ray cluster: attaches to the running controller, never starts one, never clears."""

    options: TransferQueueConfig
    namespace: str

    def open(self) -> TransferQueueDataPlane:
        plane = _opened.get(self.namespace)
        if plane is None:
            if not runtime.controller_running():
                raise WorkerError(
                    f"no TransferQueue controller runs in this Ray cluster, so the driver's partitions "
                    f"(namespace '{self.namespace}') cannot be reached: the driver's data plane has stopped"
                )
            plane = _opened[self.namespace] = TransferQueueDataPlane(self.options, self.namespace, exclusive=False)
        return plane


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)} in all)" if len(keys) > 1 else f"'{keys[0]}'"
