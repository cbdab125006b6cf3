"""A resumable data loader: batches in a seeded order, with its exact position in a state dict.

Epoch ``e`` visits the samples in the order ``permutation(seed, e)`` (NumPy's generator seeded
with ``[seed, e]``, so the order depends on nothing but those two numbers) and cuts it into
consecutive batches. ``state_dict()`` is ``{epoch, position}`` (plus what must match on
restore), where ``position`` counts the batches of that epoch already handed out: a loader
restored from it yields exactly the batches the saved one would have yielded next.

A dataset that orders its own epochs (a mixture of sources,
:class:`~posttrain.data.mixture.MixedDataset`: ``epoch_size()`` and
``epoch_order(seed, epoch, shuffle, first_batch=, batch_size=)``, a function of those alone) is
cut into batches the same way, and its state keeps the mixture's ``signature()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from posttrain.batch import Batch
from posttrain.errors import CheckpointError, DataError


class BatchSource(Protocol):
    """What the loader reads: a sized collection that collates samples by index."""

    def __len__(self) -> int: ...

    def collate(self, indices: Sequence[int]) -> Batch: ...


class StatefulDataLoader:
    """Batches of ``batch_size`` samples (examples; a preference example gives two rows).

    Iterating yields the rest of the current epoch and then stops; the next iteration runs
    the next epoch. The state advances as each batch is handed out, so a checkpoint taken
    after a training step resumes at the following batch. With ``drop_last`` the final
    partial batch of an epoch is left out (every step sees a full global batch).
    """

    def __init__(self, dataset: BatchSource, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if len(self) == 0:
            raise DataError(
                f"the dataset has {self.samples_per_epoch} samples per epoch, fewer than one batch of {batch_size}; "
                "lower the batch size or add data"
            )
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = self.samples_per_epoch
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def samples_per_epoch(self) -> int:
        epoch_size = getattr(self.dataset, "epoch_size", None)
        return epoch_size() if epoch_size is not None else len(self.dataset)

    def order(self, epoch: int) -> list[int]:
        """The sample order of ``epoch``."""
        epoch_order = getattr(self.dataset, "epoch_order", None)
        if epoch_order is not None:
            return epoch_order(self.seed, epoch, self.shuffle, first_batch=epoch * len(self), batch_size=self.batch_size)
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(n).tolist()

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Batches ``start``, ``start+1``, ... of ``epoch``, without touching the loader's state."""
        order = self.order(epoch)
        for k in range(start, len(self)):
            yield self.dataset.collate(order[k * self.batch_size: (k + 1) * self.batch_size])

    def __iter__(self) -> Iterator[Batch]:
        epoch = self.epoch
        for batch in self.epoch_batches(epoch, self.position):
            self.position += 1
            if self.position == len(self):
                self.epoch, self.position = epoch + 1, 0
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.samples_per_epoch,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            **({"mixture": self.dataset.signature()} if hasattr(self.dataset, "signature") else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; refuses state saved for other data or settings."""
        mine = self.state_dict()
        changed = [
            f"{key} {state.get(key)!r} -> {mine[key]!r}"
            for key in ("num_samples", "batch_size", "seed", "shuffle", "drop_last", "mixture")
            if state.get(key) != mine.get(key)
        ]
        if changed:
            raise CheckpointError(
                f"the saved data loader position does not fit this data loader ({'; '.join(changed)}): "
                "the dataset or its settings changed since the checkpoint; restore them or start a new run"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
