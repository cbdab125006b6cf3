"""Supervised fine-tuning loss: token-level negative log-likelihood."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType


class NLLLoss(LossFunction):
    """Mean negative log-likelihood of the loss tokens over the global batch.

    With ``m = token_mask * sample_mask`` and ``N`` the global count of valid tokens (sum of
    ``m`` over every microbatch and rank), a microbatch contributes
    ``-sum_{i,t} m[i, t] * logprobs[i, t] / N``; the contributions sum to the global mean.
    A global batch without loss tokens gives 0, not NaN.
    """

    loss_type = LossType.TOKEN

    @classmethod
    def from_options(cls, options: Any = None) -> NLLLoss:
        """The registry factory; NLL has no options (``options`` is the ``sft`` section)."""
        return cls()

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["token_mask"].to(logprobs) * batch["sample_mask"].to(logprobs)[:, None]
        # where(): a -inf logprob on a masked position must not turn 0 * -inf into NaN
        token_logprobs = torch.where(mask != 0, logprobs, torch.zeros_like(logprobs)) * mask
        loss = -token_logprobs.sum() / global_valid_toks.to(logprobs).clamp(min=1)
        return loss, {"loss": loss.item()}
