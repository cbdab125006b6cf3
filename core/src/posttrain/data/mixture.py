"""Several datasets read as one: a list of sources under ``data.train`` or ``data.validation``.

Each source is read, renamed and checked on its own (its ``columns``; its ``task`` given to
its prompt rows that name none) and keeps its rows' numbers for messages. A batch of a
mixture may hold samples of every source; prompt batches say which in ``source`` (the
source's ``tag``), so a rollout reports ``data/<tag>/...`` metrics per source.

One epoch of a training mixture, seeded by ``(seed, epoch)`` alone (so a loader's
``{epoch, position}`` resumes it exactly):

- a source with ``count`` gives exactly that many samples;
- the sources with a ``weight`` share as many samples as they hold together, each sample's
  source drawn with probability ``weight / sum of weights``; with a ``weight_schedule``, the
  weights of the loader batch the sample lands in (a curriculum);
- any other source gives each of its rows once.

Within a source, samples are taken from its rows in a fresh random order per pass (file order
without shuffling), passes repeating as often as the count or the draw asks. With shuffling
the epoch's places are handed out at random (the counted and unweighted sources' samples
first, the weighted sources' draws in the rest); without it, source after source, then the
draws.
A validation mixture reads every row of every source once, in order.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

import attrs

from posttrain.batch import Batch
from posttrain.config.schema import DataSource
from posttrain.data.dataset import TokenizedDataset, collate_rows
from posttrain.errors import ConfigError


@attrs.frozen
class Share:
    """What one source gives an epoch: ``count`` samples, or a ``weight`` of the weighted
    part (constant, or a ``schedule`` of ``(batch, weight)`` points, linear between them), or
    (neither) each of its rows once."""

    tag: str
    weight: float | None = None
    count: int | None = None
    schedule: tuple[tuple[float, float], ...] | None = None

    @property
    def weighted(self) -> bool:
        return self.weight is not None or self.schedule is not None

    def weight_at(self, batch: float) -> float:
        """The source's weight at loader batch ``batch``."""
        if self.schedule is None:
            return float(self.weight or 0.0)
        points = self.schedule
        for (b0, w0), (b1, w1) in zip(points, points[1:], strict=False):
            if batch < b1:
                return w0 + (w1 - w0) * (batch - b0) / (b1 - b0)
        return points[-1][1]


class MixedDataset:
    """Datasets of one kind (:class:`TokenizedDataset`, one per source) read as one: index
    ``i`` is row ``i - offset`` of the source whose rows it falls in, sources in list order."""

    def __init__(self, parts: Sequence[TokenizedDataset], shares: Sequence[Share]):
        if len(parts) != len(shares) or not parts:
            raise ValueError(f"a mixture needs one share per source, got {len(parts)} sources and {len(shares)} shares")
        kinds = {part.kind for part in parts}
        if len(kinds) > 1:
            raise ValueError(f"the sources of a mixture must be of one kind, found {sorted(kinds)}")
        self.parts: tuple[TokenizedDataset, ...] = tuple(parts)
        self.shares: tuple[Share, ...] = tuple(shares)
        self.kind = parts[0].kind
        self.pad_token_id = parts[0].pad_token_id
        self.images = parts[0].images
        weighted = [share for share in shares if share.weighted]
        # the sum of linear pieces is positive everywhere when it is at every point where a piece begins
        for batch in sorted({0.0, *(b for share in weighted for b, _ in share.schedule or ())}):
            total = sum(share.weight_at(batch) for share in weighted)
            if weighted and not total > 0:
                tags = ", ".join(share.tag for share in weighted)
                at = f" at batch {batch:g}" if any(share.schedule for share in weighted) else ""
                raise ConfigError(f"the weights of the mixture's sources ({tags}) sum to {total:g}{at}; "
                                  "give at least one of them a weight above 0")

    @property
    def sizes(self) -> list[int]:
        """Rows in each source now (checks may leave malformed rows out after loading)."""
        return [len(part) for part in self.parts]

    def __len__(self) -> int:
        return sum(self.sizes)

    def offsets(self) -> list[int]:
        """Where each source's rows begin in the mixture, and its length last."""
        return list(itertools.accumulate(self.sizes, initial=0))

    def locate(self, index: int, offsets: Sequence[int] | None = None) -> tuple[int, int]:
        """(source, row within it) of mixture index ``index`` (``offsets``: :meth:`offsets`,
        when the caller has them)."""
        offsets = self.offsets() if offsets is None else offsets
        if not 0 <= index < offsets[-1]:
            raise IndexError(f"index {index} is outside the mixture's {offsets[-1]} rows")
        source = bisect.bisect_right(offsets, index) - 1
        return source, index - offsets[source]

    def rows(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The stored columns of the examples at ``indices`` (in that order), with ``origin``
        and ``source`` (the tag of each example's source)."""
        offsets = self.offsets()
        wanted: dict[int, list[tuple[int, int]]] = defaultdict(list)  # source -> (position in batch, row)
        for position, index in enumerate(indices):
            source, row = self.locate(int(index), offsets)
            wanted[source].append((position, row))
        out: dict[str, list[Any]] = {}
        for source, picks in wanted.items():
            cols = {**self.parts[source].rows([row for _, row in picks]), "source": [self.shares[source].tag] * len(picks)}
            for name, values in cols.items():
                column = out.setdefault(name, [None] * len(indices))
                for (position, _), value in zip(picks, values, strict=True):
                    column[position] = value
        return out

    def collate(self, indices: Sequence[int]) -> Batch:
        return collate_rows(self.kind, self.rows(indices), self.pad_token_id, self.images)

    # ------------------------------------------------------------------ epochs

    def epoch_size(self) -> int:
        """Samples per epoch (the same every epoch)."""
        return sum(share.count if share.count is not None else size
                   for share, size in zip(self.shares, self.sizes, strict=True))

    def epoch_order(self, seed: int, epoch: int, shuffle: bool, *, first_batch: int = 0, batch_size: int = 1) -> list[int]:
        """The mixture indices of epoch ``epoch``'s samples, in order (module docstring).
        ``first_batch`` is the loader's count of batches before this epoch and ``batch_size``
        its batch size: a weight schedule's weights are those of each sample's batch."""
        import numpy as np

        sizes, offsets = self.sizes, self.offsets()
        weighted = [i for i, share in enumerate(self.shares) if share.weighted]
        fixed = [offsets[i] + row for i, share in enumerate(self.shares) if not share.weighted
                 for row in self._rows(i, share.count if share.count is not None else sizes[i], seed, epoch, shuffle)]
        total = len(fixed) + sum(sizes[i] for i in weighted)
        rng = np.random.default_rng([seed, epoch, 1])
        positions = rng.permutation(total).tolist() if shuffle else list(range(total))
        order: list[int | None] = [None] * total
        for position, index in zip(positions, fixed, strict=False):
            order[position] = index
        slots = sorted(positions[len(fixed):])  # the weighted sources' places, each drawn by its batch's weights
        drawn: dict[int, list[int]] = {i: [] for i in weighted}
        start = 0
        while start < len(slots):
            batch = first_batch + slots[start] // batch_size
            end = start
            while end < len(slots) and first_batch + slots[end] // batch_size == batch:
                end += 1
            weights = np.array([self.shares[i].weight_at(batch) for i in weighted], dtype=np.float64)
            for slot, k in zip(slots[start:end], rng.choice(len(weighted), size=end - start, p=weights / weights.sum()).tolist(),
                               strict=True):
                drawn[weighted[k]].append(slot)
            start = end
        for i, places in drawn.items():
            for slot, row in zip(places, self._rows(i, len(places), seed, epoch, shuffle), strict=True):
                order[slot] = offsets[i] + row
        return order  # type: ignore[return-value]

    def _rows(self, source: int, take: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
        """``take`` rows of ``source``: passes over its rows (each in a fresh random order, or
        file order), as many as it takes."""
        import numpy as np

        size = self.sizes[source]
        rows: list[int] = []
        for lap in range(-(-take // size)):
            rows.extend(np.random.default_rng([seed, epoch, 2, source, lap]).permutation(size).tolist()
                        if shuffle else range(size))
        return rows[:take]

    def signature(self) -> list[list[Any]]:
        """What a resumed run's mixture must match: each source's tag, rows, weight, count and schedule."""
        return [[share.tag, size, share.weight, share.count, [list(p) for p in share.schedule or ()]]
                for share, size in zip(self.shares, self.sizes, strict=True)]


def source_tag(spec: str | DataSource) -> str:
    """A source's tag: its own ``tag``, else the file or folder's stem, or a Hub id's last part."""
    if isinstance(spec, DataSource):
        if spec.tag:
            return spec.tag
        return spec.name.rsplit("/", 1)[-1] if spec.name else PurePath(str(spec.path)).stem
    return PurePath(str(spec)).stem
