"""Small stand-ins shared by several test modules."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.batch import Batch


class Numbers:
    """A dataset of the samples 0..n-1: a batch of indices collates to ``value`` = those indices."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def collate(self, indices: Sequence[int]) -> Batch:
        return Batch(value=torch.tensor(list(indices)))
