"""The prompt stream of a GRPO run: prompt batches epoch after epoch from a resumable data
loader, whose position a checkpoint keeps (``dataloader.pt`` of core's
:class:`~posttrain.run.checkpoint.TrainingState`)."""

from __future__ import annotations

from posttrain.batch import Batch
from posttrain.data import StatefulDataLoader


class PromptStream:
    """Prompt batches from a resumable data loader, epoch after epoch, for at most
    ``max_epochs`` epochs. Each :meth:`next` advances the loader's saved position."""

    def __init__(self, loader: StatefulDataLoader, max_epochs: int):
        self.loader = loader
        self.max_epochs = max_epochs

    @property
    def total_batches(self) -> int:
        """Batches in all epochs together."""
        return self.max_epochs * len(self.loader)

    def next(self) -> Batch | None:
        """The next batch of prompts, or None once ``max_epochs`` epochs are done."""
        if self.loader.epoch >= self.max_epochs:
            return None
        return next(iter(self.loader))
