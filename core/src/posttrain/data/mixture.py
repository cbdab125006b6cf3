"""Several datasets read as one: a list of sources under ``data.train`` or ``data.validation``.

Each source is read, renamed and checked on its own (its ``columns``; its ``task`` given to
its prompt rows that name none) and keeps its rows' numbers for messages. A batch of a
mixture may hold samples of every source; prompt batches say which in ``source`` (the
source's ``tag``), so a rollout reports ``data/<tag>/...`` metrics per source.

One epoch of a training mixture, seeded by ``(seed, epoch)`` alone (so a loader's
``{epoch, position}`` resumes it exactly):

- a source with ``count`` gives exactly that many samples;
- the sources with a ``weight`` share as many samples as they hold together, each sample's
  source drawn with probability ``weight / sum of weights`` (a multinomial draw);
- any other source gives each of its rows once.

Within a source, samples are taken from its rows in a fresh random order per pass (file order
without shuffling), passes repeating as often as the count or the draw asks. With shuffling
the epoch's samples are then put in a random order; without it, source after source.
A validation mixture reads every row of every source once, in order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import attrs

from posttrain.batch import Batch
from posttrain.data.dataset import TokenizedDataset, collate_rows
from posttrain.errors import ConfigError


@attrs.frozen
class Share:
    """What one source gives an epoch: ``count`` samples, or a ``weight`` of the weighted
    part, or (neither) each of its rows once."""

    tag: str
    weight: float | None = None
    count: int | None = None


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
        weights = [share.weight for share in shares if share.weight is not None]
        if weights and not sum(weights) > 0:
            tags = ", ".join(share.tag for share in shares if share.weight is not None)
            raise ConfigError(f"the weights of the mixture's sources ({tags}) sum to {sum(weights):g}; "
                              "give at least one of them a weight above 0")

    @property
    def sizes(self) -> list[int]:
        """Rows in each source now (checks may leave malformed rows out after loading)."""
        return [len(part) for part in self.parts]

    def __len__(self) -> int:
        return sum(self.sizes)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, row within it) of mixture index ``index``."""
        for source, size in enumerate(self.sizes):
            if index < size:
                return source, index
            index -= size
        raise IndexError(f"index {index + len(self)} is outside the mixture's {len(self)} rows")

    def rows(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The stored columns of the examples at ``indices`` (in that order), with ``origin``
        and ``source`` (the tag of each example's source)."""
        wanted: dict[int, list[tuple[int, int]]] = defaultdict(list)  # source -> (position in batch, row)
        for position, index in enumerate(indices):
            source, row = self.locate(int(index))
            wanted[source].append((position, row))
        out: list[dict[str, Any] | None] = [None] * len(indices)
        for source, picks in wanted.items():
            cols = self.parts[source].rows([row for _, row in picks])
            for k, (position, _) in enumerate(picks):
                out[position] = {**{name: values[k] for name, values in cols.items()}, "source": self.shares[source].tag}
        names = list(out[0]) if out else []
        return {name: [example[name] for example in out] for name in names}  # type: ignore[index]

    def collate(self, indices: Sequence[int]) -> Batch:
        return collate_rows(self.kind, self.rows(indices), self.pad_token_id)

    # ------------------------------------------------------------------ epochs

    def takes(self, seed: int, epoch: int) -> list[int]:
        """How many samples each source gives epoch ``epoch``."""
        import numpy as np

        sizes = self.sizes
        takes = [share.count if share.count is not None else (size if share.weight is None else 0)
                 for share, size in zip(self.shares, sizes, strict=True)]
        weighted = [i for i, share in enumerate(self.shares) if share.weight is not None]
        if weighted:
            weights = np.array([self.shares[i].weight for i in weighted], dtype=np.float64)
            drawn = np.random.default_rng([seed, epoch, 1]).multinomial(sum(sizes[i] for i in weighted),
                                                                         weights / weights.sum())
            for i, n in zip(weighted, drawn.tolist(), strict=True):
                takes[i] = n
        return takes

    def epoch_size(self) -> int:
        """Samples per epoch (the same every epoch)."""
        return sum(share.count if share.count is not None else size
                   for share, size in zip(self.shares, self.sizes, strict=True))

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> list[int]:
        """The mixture indices of epoch ``epoch``'s samples, in order (module docstring)."""
        import numpy as np

        offsets = np.cumsum([0, *self.sizes]).tolist()
        picks: list[int] = []
        for source, (size, take) in enumerate(zip(self.sizes, self.takes(seed, epoch), strict=True)):
            rows: list[int] = []
            for lap in range(-(-take // size)):
                rng = np.random.default_rng([seed, epoch, 2, source, lap])
                rows.extend(rng.permutation(size).tolist() if shuffle else range(size))
            picks.extend(offsets[source] + row for row in rows[:take])
        if shuffle:
            order = np.random.default_rng([seed, epoch, 3]).permutation(len(picks))
            picks = [picks[j] for j in order.tolist()]
        return picks

    def signature(self) -> list[list[Any]]:
        """What a resumed run's mixture must match: each source's tag, rows, weight and count."""
        return [[share.tag, size, share.weight, share.count] for share, size in zip(self.shares, self.sizes, strict=True)]


def source_tag(spec: Any) -> str:
    """The default tag of a source: the file or folder's stem, or a Hub id's last part."""
    from pathlib import PurePath

    from posttrain.config.schema import DataSource

    if isinstance(spec, DataSource):
        if spec.tag:
            return spec.tag
        return spec.name.rsplit("/", 1)[-1] if spec.name else PurePath(str(spec.path)).stem
    return PurePath(str(spec)).stem
