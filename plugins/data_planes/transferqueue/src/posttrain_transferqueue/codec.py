"""Batch fields to TransferQueue columns and back.

A tensor field [B, ...] is stored as it is: TransferQueue keeps one row per sample. A list
field (message logs, dicts, strings) becomes a ``NonTensorStack`` of the per-sample Python
objects, which TransferQueue serialises per sample. Reading back, TransferQueue returns rows
of 1-D+ tensor fields as a jagged nested tensor (rows may differ in width when they were
written by different puts): they are right-padded with 0 to the widest selected row, and
list fields are collated like :meth:`posttrain.batch.Batch.from_samples`, so a get returns
exactly what the in-memory plane returns.

Tags travel as TransferQueue's per-sample ``custom_meta``, held by its controller and listed
without touching storage. Each is stored as a plain Python value under ``"<name>:<dtype>"``
(``"keep:bool"``, ``"length:int32"``): plain values cost the controller a small fraction of
what one tensor per sample costs, and the key keeps the dtype for any process that lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack

from posttrain.batch import Batch

OBJECT = "object"  # the kind of a list field; tensor fields' kind is their dtype


def field_kind(value: Any) -> str:
    """``"torch.float32"``-style dtype for tensor fields, ``"object"`` for list fields."""
    return str(value.dtype) if isinstance(value, torch.Tensor) else OBJECT


def encode(fields: Mapping[str, Any], num_samples: int) -> TensorDict:
    """The TransferQueue columns of ``fields`` (each with ``num_samples`` rows)."""
    columns: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise TypeError(f"data plane put: field '{name}' is a nested tensor; pad it or pass a list of tensors")
            columns[name] = value.detach().cpu()
        else:
            columns[name] = NonTensorStack(*value)
    return TensorDict(columns, batch_size=[num_samples])


def decode(name: str, column: Any) -> torch.Tensor | list[Any]:
    """One field of a get, as the in-memory plane returns it."""
    if isinstance(column, torch.Tensor):
        return column.to_padded_tensor(0) if column.is_nested else column
    objects = column.tolist()
    return Batch.from_samples([{name: obj} for obj in objects])[name]


def encode_tags(tags: Mapping[str, Any], samples: list[dict[str, Any]]) -> None:
    """Write row ``i`` of each tag into ``samples[i]`` (a sample's ``custom_meta``),
    replacing the tag's earlier value whatever its dtype was."""
    columns = {name: torch.as_tensor(value) for name, value in tags.items()}
    for i, sample in enumerate(samples):
        for name, column in columns.items():
            for old in [key for key in sample if key.rpartition(":")[0] == name]:
                del sample[old]
            sample[f"{name}:{str(column.dtype).removeprefix('torch.')}"] = column[i].tolist()


def decode_tags(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Tags of ``samples`` (custom_meta in key order) as tensors [len(samples), ...],
    names sorted, like the in-memory plane's ``tags``."""
    rows = [
        {
            key.rpartition(":")[0]: torch.tensor(value, dtype=getattr(torch, key.rpartition(":")[2]))
            for key, value in sample.items()
        }
        for sample in samples
    ]
    names = sorted({name for row in rows for name in row})
    return {name: torch.stack([row[name] for row in rows]) for name in names}
