"""Loss functions: how a batch's logprobs become a scalar to minimise.

Global normalisation: the policy counts valid tokens (``token_mask * sample_mask``) and
valid sequences over the *whole global batch* before training, and passes those counts to
every microbatch call. Each call divides by the global counts, and the policy sums the
microbatch losses, so gradient accumulation equals one full-batch step exactly.
"""

from __future__ import annotations

import abc
import enum

import torch

from posttrain.batch import Batch


class LossType(enum.Enum):
    TOKEN = "token"  # normalised by the global number of valid tokens
    SEQUENCE = "sequence"  # normalised by the global number of valid sequences


class LossFunction(abc.ABC):
    """A loss over next-token logprobs."""

    loss_type: LossType = LossType.TOKEN

    @abc.abstractmethod
    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one microbatch.

        ``logprobs`` float32 [b, S] holds the current weights' next-token logprobs in the
        policy's convention, with gradient. ``batch`` is the microbatch (same rows).
        ``global_valid_seqs`` and ``global_valid_toks`` are scalar tensors over the global
        batch. Each metric is a contribution that sums to its global value over all
        microbatches and ranks (normalise metrics the same way as the loss).
        """
