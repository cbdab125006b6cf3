"""The batch that moves between driver and workers: named per-sample fields.

A :class:`Batch` maps field names to either a tensor whose first dimension is the number of
samples, or a list with one Python object per sample (message logs, task names, metadata).
It is a plain container: sharding, microbatching, balancing and packing are pure functions
of the sample lengths (below) that return index lists, applied with :meth:`Batch.select`.

Why not tensordict: per-sample Python objects and ragged lists are first-class here, and
every operation is an index selection; tensordict's non-tensor stacks add cost without
removing code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import attrs
import torch


class Batch(MutableMapping[str, Any]):
    """Named per-sample fields of equal length ``len(batch)``."""

    def __init__(self, fields: Mapping[str, Any] | None = None, **kwargs: Any):
        self._fields: dict[str, Any] = {}
        for name, value in {**(fields or {}), **kwargs}.items():
            self[name] = value

    # ---------------------------------------------------------------- mapping protocol

    def __getitem__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(f"batch has no field '{name}'; fields: {sorted(self._fields)}") from None

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(value, (torch.Tensor, list)):
            raise TypeError(f"batch field '{name}' must be a tensor or a list, got {type(value).__name__}")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            raise ValueError(f"batch field '{name}' is a scalar tensor; fields need a sample dimension")
        if self._fields:
            size = len(self)
            if _length(value) != size:
                raise ValueError(f"batch field '{name}' has {_length(value)} samples, the batch has {size}")
        self._fields[name] = value

    def __delitem__(self, name: str) -> None:
        del self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        """The number of samples (not fields)."""
        for value in self._fields.values():
            return _length(value)
        return 0

    @property
    def size(self) -> int:
        return len(self)

    def __repr__(self) -> str:
        parts = [
            f"{k}={tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) else f"{k}=list"
            for k, v in self._fields.items()
        ]
        return f"Batch(size={len(self)}, {', '.join(parts)})"

    # ---------------------------------------------------------------- selection

    def select(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """The samples at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        ilist = idx.tolist()
        return Batch({k: v[idx] if isinstance(v, torch.Tensor) else [v[i] for i in ilist] for k, v in self._fields.items()})

    def slice(self, start: int, stop: int) -> Batch:
        return Batch({k: v[start:stop] for k, v in self._fields.items()})

    def fields(self, names: Iterable[str]) -> Batch:
        """A batch with only the named fields (sharing storage)."""
        return Batch({n: self[n] for n in names})

    def update(self, other: Mapping[str, Any] = (), **kwargs: Any) -> None:  # type: ignore[override]
        for k, v in dict(other, **kwargs).items():
            self[k] = v

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each sample ``repeats`` times in a row: [a, b] -> [a, a, b, b] (for N generations)."""
        return self.select(torch.arange(len(self)).repeat_interleave(repeats))

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self._fields.items()})

    def microbatches(self, size: int) -> Iterator[Batch]:
        """Consecutive microbatches of ``size`` samples (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"microbatch size must be positive, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, start + size)

    # ---------------------------------------------------------------- construction

    @classmethod
    def concat(cls, batches: Sequence[Batch], pad_values: Mapping[str, float | int] | None = None) -> Batch:
        """Stack batches sample-wise. 2-D+ tensor fields of different widths are right-padded
        with ``pad_values[name]`` (default 0)."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls()
        names = list(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != set(names):
                raise ValueError(f"cannot concat batches with different fields: {sorted(names)} vs {sorted(b.keys())}")
        out = {}
        for name in names:
            values = [b[name] for b in batches]
            if isinstance(values[0], torch.Tensor):
                out[name] = _cat_padded(values, (pad_values or {}).get(name, 0))
            else:
                out[name] = [x for v in values for x in v]
        return cls(out)

    @classmethod
    def from_samples(cls, samples: Sequence[Mapping[str, Any]], pad_values: Mapping[str, float | int] | None = None) -> Batch:
        """Collate per-sample dicts. Tensor values are stacked (1-D+ tensors right-padded
        with ``pad_values[name]``, default 0); Python numbers become 1-D tensors; anything
        else becomes a list."""
        if not samples:
            return cls()
        out: dict[str, Any] = {}
        for name in samples[0]:
            values = [s[name] for s in samples]
            first = values[0]
            if isinstance(first, torch.Tensor):
                out[name] = _cat_padded([v.unsqueeze(0) for v in values], (pad_values or {}).get(name, 0))
            elif isinstance(first, (bool, int, float)):
                out[name] = torch.tensor(values)
            else:
                out[name] = list(values)
        return cls(out)

    @staticmethod
    def restore_order(shards: Sequence[Batch], indices: Sequence[Sequence[int]], pad_values: Mapping[str, float | int] | None = None) -> Batch:
        """Inverse of ``[batch.select(i) for i in indices]``: put shard results back in
        the original sample order."""
        flat = [i for idx in indices for i in idx]
        inverse = torch.empty(len(flat), dtype=torch.long)
        inverse[torch.as_tensor(flat, dtype=torch.long)] = torch.arange(len(flat))
        return Batch.concat(shards, pad_values).select(inverse)


def padded_tensor(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """``rows`` (lists of numbers) as one [len(rows), width] tensor, each row right-padded
    with ``value`` (``width``: the longest row's length unless given). Each row is copied
    into the tensor's numpy view (``dtype`` must be one numpy has), a third of the time of
    one ``torch.tensor`` of the padded lists."""
    width = max((len(row) for row in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    array = out.numpy()
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return out


def _length(value: Any) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)


def _cat_padded(tensors: Sequence[torch.Tensor], pad_value: float | int) -> torch.Tensor:
    if tensors[0].dim() >= 2 and len({t.shape[1:] for t in tensors}) > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [
            torch.nn.functional.pad(t, (0, width - t.shape[1]) if t.dim() == 2 else _pad_dim1(t, width), value=pad_value)
            for t in tensors
        ]
    return torch.cat(list(tensors), dim=0)


def _pad_dim1(t: torch.Tensor, width: int) -> tuple[int, ...]:
    # F.pad pads from the last dim backwards; pad only dim 1 of an N-D tensor.
    return (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])


# ==================================================================== index planning
#
# Every function below takes sample lengths and returns lists of sample indices. They never
# touch tensors, so the driver can plan with lengths alone (e.g. from a data plane's tags).


def shard_indices(num_samples: int, num_shards: int) -> list[list[int]]:
    """Split ``range(num_samples)`` into ``num_shards`` contiguous, equal shards."""
    if num_samples % num_shards:
        raise ValueError(f"{num_samples} samples cannot be split evenly over {num_shards} data-parallel ranks")
    per = num_samples // num_shards
    return [list(range(r * per, (r + 1) * per)) for r in range(num_shards)]


def balanced_shard_indices(lengths: Sequence[int], num_shards: int) -> list[list[int]]:
    """Split samples over ``num_shards`` ranks with equal counts and near-equal token sums.

    Greedy: longest sample first, to the non-full shard with the fewest tokens so far.
    Each shard's indices are returned sorted, so relative order is kept within a rank.
    """
    n = len(lengths)
    if n % num_shards:
        raise ValueError(f"{n} samples cannot be split evenly over {num_shards} data-parallel ranks")
    per = n // num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    tokens = [0] * num_shards
    for i in sorted(range(n), key=lambda i: (-int(lengths[i]), i)):
        r = min((r for r in range(num_shards) if len(shards[r]) < per), key=lambda r: (tokens[r], r))
        shards[r].append(i)
        tokens[r] += int(lengths[i])
    return [sorted(s) for s in shards]


def token_budget_microbatches(lengths: Sequence[int], max_tokens: int, round_to: int = 1) -> list[list[int]]:
    """Dynamic batching: group samples so each microbatch's padded size fits a token budget.

    Samples are sorted by length; a microbatch holds as many as keep
    ``count * padded_max_length <= max_tokens``, where the max length is rounded up to a
    multiple of ``round_to``. A sample longer than the budget gets a microbatch alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = _round_up(int(lengths[i]), round_to)
        if current and (len(current) + 1) * width > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def equalize_microbatch_counts(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Split microbatches until every rank has the same number (collectives need it).

    The largest microbatch of a short rank is halved until the counts match.
    """
    target = max(len(mbs) for mbs in per_rank)
    out = []
    for mbs in per_rank:
        mbs = [list(mb) for mb in mbs]
        while len(mbs) < target:
            j = max(range(len(mbs)), key=lambda j: len(mbs[j]))
            if len(mbs[j]) < 2:
                raise ValueError(f"cannot make {target} microbatches from {sum(map(len, mbs))} samples")
            half = len(mbs[j]) // 2
            mbs[j:j + 1] = [mbs[j][:half], mbs[j][half:]]
        out.append(mbs)
    return out


def pack_bins(lengths: Sequence[int], max_tokens_per_row: int) -> list[list[int]]:
    """Sequence packing plan: first-fit decreasing of samples into rows of a token budget.

    Returns one list of sample indices per packed row. A sample longer than the budget is
    an error (truncate first): packing never splits a sequence.
    """
    too_long = [i for i, n in enumerate(lengths) if int(n) > max_tokens_per_row]
    if too_long:
        raise ValueError(
            f"sample {too_long[0]} has {int(lengths[too_long[0]])} tokens, more than the packing "
            f"budget of {max_tokens_per_row} tokens per row; raise the budget or truncate"
        )
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(max_tokens_per_row - n)
    return rows


@attrs.frozen
class PackedRows:
    """Several sequences laid end to end in each row.

    ``segment_ids`` [R, T] numbers the sequences within a row from 0 (-1 on padding);
    ``position_ids`` [R, T] restart at 0 for every sequence; attention must stay within a
    segment (see :meth:`attention_mask`). ``bins`` maps rows back to sample indices.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    bins: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]  # per original sample

    def attention_mask(self) -> torch.Tensor:
        """Boolean [R, 1, T, T]: True where query t may attend to key s (same segment, s <= t)."""
        seg = self.segment_ids
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        causal = torch.ones(seg.shape[1], seg.shape[1], dtype=torch.bool).tril()
        return (same & causal)[:, None]

    def segment_bounds(self) -> torch.Tensor:
        """Cumulative segment bounds over the flattened ``[R x T]`` tokens (int32, starting
        at 0, ending at ``R * T``), the layout of variable-length attention kernels' ``cu_seqlens``;
        a row's padding tail is a segment of its own."""
        width = self.input_ids.shape[1]
        bounds = [0]
        for r, row in enumerate(self.bins):
            offset = r * width
            for i in row:
                offset += self.lengths[i]
                if offset > bounds[-1]:
                    bounds.append(offset)
            if offset < (r + 1) * width:
                bounds.append((r + 1) * width)
        return torch.tensor(bounds, dtype=torch.int32)

    def token_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where every real token sits: ``(row, column)`` in the packed layout and
        ``(sample, position)`` in the per-sample layout, four aligned 1-D index tensors."""
        rows, cols, samples, positions = [], [], [], []
        for r, row in enumerate(self.bins):
            offset = 0
            for i in row:
                n = self.lengths[i]
                rows.append(torch.full((n,), r))
                cols.append(torch.arange(offset, offset + n))
                samples.append(torch.full((n,), i))
                positions.append(torch.arange(n))
                offset += n
        return torch.cat(rows), torch.cat(cols), torch.cat(samples), torch.cat(positions)

    def pack(self, values: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """Lay a per-sample [B, S, ...] tensor out like ``input_ids`` ([R, T, ...])."""
        out = values.new_full((len(self.bins), self.input_ids.shape[1], *values.shape[2:]), pad_value)
        row, col, sample, position = (i.to(values.device) for i in self.token_index())
        out[row, col] = values[sample, position]
        return out

    def unpack(self, values: torch.Tensor, width: int, pad_value: float | int = 0) -> torch.Tensor:
        """Inverse of :meth:`pack`: [R, T, ...] back to per-sample [B, width, ...]. One
        gather (its backward is one scatter, not one full-size zero tensor per sample)."""
        out = values.new_full((len(self.lengths), width, *values.shape[2:]), pad_value)
        row, col, sample, position = (i.to(values.device) for i in self.token_index())
        out[sample, position] = values[row, col]
        return out


def pack_sequences(
    input_ids: torch.Tensor, lengths: torch.Tensor, max_tokens_per_row: int, pad_token_id: int = 0, round_to: int = 1
) -> PackedRows:
    """Pack right-padded sequences [B, S] into rows of at most ``max_tokens_per_row`` tokens
    (row width rounded up to a multiple of ``round_to``)."""
    lens = [int(n) for n in lengths]
    bins = pack_bins(lens, max_tokens_per_row)
    width = _round_up(max(sum(lens[i] for i in row) for row in bins), round_to)
    ids = input_ids.new_full((len(bins), width), pad_token_id)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    seg = torch.full((len(bins), width), -1, dtype=torch.long)
    for r, row in enumerate(bins):
        offset = 0
        for s, i in enumerate(row):
            n = lens[i]
            ids[r, offset:offset + n] = input_ids[i, :n]
            pos[r, offset:offset + n] = torch.arange(n)
            seg[r, offset:offset + n] = s
            offset += n
    return PackedRows(ids, pos, seg, tuple(tuple(b) for b in bins), tuple(lens))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
