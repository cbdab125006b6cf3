"""What a GRPO run carries across a resume besides the policy: the prompt stream's
position and the driver's random states, and the checkpoint files that hold them.

A GRPO checkpoint folder (``step_N/``, written atomically by
:class:`~posttrain.run.checkpoint.CheckpointManager`, which adds ``training_info.json`` and
``config.yaml``) holds::

    policy/         Policy.save_checkpoint: weights, optimizer, scheduler
    dataloader.pt   the training data loader's position (StatefulDataLoader.state_dict)
    rng.pt          the driver's Python, NumPy and torch random states
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.batch import Batch
from posttrain.data import StatefulDataLoader
from posttrain.errors import CheckpointError
from posttrain.interfaces import Policy
from posttrain.run.checkpoint import rng_state, set_rng_state

POLICY_DIR = "policy"
DATALOADER_FILE = "dataloader.pt"
RNG_FILE = "rng.pt"


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


def write_checkpoint(folder: Path, policy: Policy, prompts: PromptStream) -> None:
    """Fill a checkpoint folder (see the module docstring)."""
    policy.save_checkpoint(str(folder / POLICY_DIR))
    torch.save(prompts.loader.state_dict(), folder / DATALOADER_FILE)
    torch.save(rng_state(), folder / RNG_FILE)


def read_checkpoint(folder: Path, policy: Policy, prompts: PromptStream) -> None:
    """Restore the policy, the data loader position and the driver's random states from a
    folder :func:`write_checkpoint` filled."""
    missing = [name for name in (POLICY_DIR, DATALOADER_FILE, RNG_FILE) if not (folder / name).exists()]
    if missing:
        raise CheckpointError(
            f"checkpoint {folder} has no {', '.join(missing)}; it was not written by a GRPO run. "
            "Point checkpointing.dir at a GRPO run's checkpoints, or set checkpointing.resume=false"
        )
    policy.load_checkpoint(str(folder / POLICY_DIR))
    prompts.loader.load_state_dict(torch.load(folder / DATALOADER_FILE))
    set_rng_state(torch.load(folder / RNG_FILE))
