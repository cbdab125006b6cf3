"""The prompt stream of a GRPO run: prompt batches epoch after epoch from a resumable data
loader, whose position a checkpoint keeps (``dataloader.pt`` of core's
:class:`~posttrain.run.checkpoint.TrainingState`).

Rollouts may be generated ahead of training (asynchronous GRPO), so the position a
checkpoint keeps is not the loader's own but the one after the prompts of the last step
trained (:meth:`PromptStream.trained`): a resumed run rolls out again the prompts of the
rollouts generated ahead and lost with the stop."""

from __future__ import annotations

from typing import Any

from posttrain.batch import Batch
from posttrain.data import StatefulDataLoader


class PromptStream:
    """Prompt batches from a resumable data loader, epoch after epoch, for at most
    ``max_epochs`` epochs. Each :meth:`next` advances the loader's saved position."""

    def __init__(self, loader: StatefulDataLoader, max_epochs: int):
        self.loader = loader
        self.max_epochs = max_epochs
        self._trained: dict[str, Any] | None = None

    @property
    def total_batches(self) -> int:
        """Batches in all epochs together."""
        return self.max_epochs * len(self.loader)

    def next(self) -> Batch | None:
        """The next batch of prompts, or None once ``max_epochs`` epochs are done."""
        if self.loader.epoch >= self.max_epochs:
            return None
        return next(iter(self.loader))

    def position(self) -> dict[str, Any]:
        """The loader's position now (after the batches handed out so far)."""
        return self.loader.state_dict()

    def trained(self, position: dict[str, Any]) -> None:
        """Record ``position`` (a :meth:`position`) as the one after the last step trained:
        what :meth:`state_dict` returns from now on."""
        self._trained = position

    def state_dict(self) -> dict[str, Any]:
        """The position a checkpoint keeps: after the last step trained (the loader's own
        before any step)."""
        return self._trained if self._trained is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` returned."""
        self.loader.load_state_dict(state)
        self._trained = None
