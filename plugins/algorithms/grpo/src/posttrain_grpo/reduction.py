"""How :class:`~posttrain_grpo.loss.ClippedPGLoss` turns per-token values [b, S] into one
microbatch's contribution to a global-batch scalar.

A token is valid where ``token_mask * sample_mask`` is 1. Contributions of the microbatches
(and data-parallel ranks) of one global batch sum to the global value, because every divisor
is a count over the global batch (``global_valid_seqs``, ``global_valid_toks``), except the
``microbatch`` token normaliser, whose divisor is the microbatch's own token count by design.
"""

from __future__ import annotations

from typing import Literal

import torch

from posttrain.batch import Batch
from posttrain_grpo.config import TokenNormalizer


class Reduction:
    """Normalises per-token values [b, S] of one microbatch.

    :meth:`metric` is a global mean: over valid tokens (``token_level``) or over valid
    sequences of their token means. :meth:`loss` is the loss's reduction: the same, except
    that with ``token_level`` the token sum is divided per ``normalizer``: ``global`` the
    global valid tokens (= :meth:`metric`); ``constant`` the global valid sequences times
    ``constant`` tokens; ``microbatch`` this microbatch's valid tokens, times the
    microbatch's share of the global valid sequences.
    """

    def __init__(
        self,
        batch: Batch,
        like: torch.Tensor,
        valid_seqs: torch.Tensor,
        valid_toks: torch.Tensor,
        *,
        token_level: bool,
        normalizer: TokenNormalizer = "global",
        constant: int | None = None,
    ):
        self.token_mask = batch["token_mask"].to(like.dtype)
        self.sample_mask = batch["sample_mask"].to(like.dtype)
        self.valid = (self.token_mask * self.sample_mask[:, None]) > 0
        self.token_level = token_level
        self.seq_count = _nonzero(valid_seqs, like)  # an empty global batch gives 0, not NaN
        self.tok_count = _nonzero(valid_toks, like)
        self.loss_count = self.tok_count if token_level else self.seq_count
        if token_level and normalizer == "constant":
            if constant is None:
                raise ValueError("token_normalizer=constant needs constant_normalizer (tokens per sequence)")
            self.loss_count = self.seq_count * constant
        elif token_level and normalizer == "microbatch":
            local_toks, local_seqs = self.valid.sum().to(like.dtype), self.sample_mask.sum()
            # sum / local_toks * local_seqs / global_seqs; a microbatch without tokens sums to 0
            self.loss_count = torch.where(
                (local_toks > 0) & (local_seqs > 0), local_toks * self.seq_count / local_seqs.clamp(min=1), 1.0
            )

    def sequence_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[b]: each sequence's mean over its ``token_mask`` (0 for a sequence without tokens)."""
        n = self.token_mask.sum(dim=1)
        return (torch.where(self.valid, x, 0.0) * self.token_mask).sum(dim=1) / torch.where(n > 0, n, 1.0)

    def sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[b]: each sequence's sum over its valid tokens."""
        return torch.where(self.valid, x, 0.0).sum(dim=1)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.token_mask.dtype)
        if self.token_level:
            return (torch.where(self.valid, x, 0.0) * self.token_mask * self.sample_mask[:, None]).sum()
        return (self.sample_mask * self.sequence_mean(x)).sum()

    def metric(self, x: torch.Tensor) -> torch.Tensor:
        """The global token mean (``token_level``) or mean of sequence means of ``x``."""
        return self._sum(x) / (self.tok_count if self.token_level else self.seq_count)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """The loss's reduction of ``x`` (see the class docstring)."""
        return self._sum(x) / self.loss_count

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """The global mean over valid sequences of per-sequence ``values`` [b]."""
        return (self.sample_mask * values.to(self.sample_mask.dtype)).sum() / self.seq_count

    def extreme(self, x: torch.Tensor, kind: Literal["max", "min"]) -> float:
        """Max or min over valid tokens; -inf / +inf when there are none."""
        values = x.detach()[self.valid]
        if values.numel() == 0:
            return float("-inf") if kind == "max" else float("inf")
        return float(values.max() if kind == "max" else values.min())


def _nonzero(count: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    return torch.where(count > 0, count, torch.ones_like(count))
