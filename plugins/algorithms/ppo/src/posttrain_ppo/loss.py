"""The critic's loss: squared error to the GAE returns, with value clipping, token-level.

The critic's outputs ``values`` [b, S] are at every position; the value it predicts for the
state before token ``t`` is its output at ``t - 1`` (:func:`~posttrain_ppo.gae.state_values`).
Per generated token (mask ``m = token_mask * sample_mask``), with the returns ``R``
(``returns``) and the values at rollout time ``V_old`` (``old_values``):

    unclipped = (V - R)^2,    clipped = (V_old + clamp(V - V_old, -c, c) - R)^2,
    loss_t = 0.5 * max(unclipped, clipped)          (0.5 * unclipped without clipping)

and the loss is ``sum m * loss_t / global_valid_toks``. Metrics (same normalisation):
``loss``, ``value_clip_fraction`` (tokens whose clipped error is the larger), ``values_mean``.
"""

from __future__ import annotations

import torch

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType
from posttrain_ppo.gae import state_values


class ValueLoss(LossFunction):
    """Clipped squared error of a value head (module docstring); ``value_clip`` None: unclipped."""

    loss_type = LossType.TOKEN
    input_type = "values"

    def __init__(self, value_clip: float | None = 0.2):
        self.value_clip = value_clip

    def __call__(
        self,
        values: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["token_mask"].to(values) * batch["sample_mask"].to(values)[:, None]
        predicted = state_values(values)
        returns = batch["returns"].to(values)
        unclipped = (predicted - returns) ** 2
        if self.value_clip is None:
            per_token, clipped_more = unclipped, torch.zeros_like(unclipped)
        else:
            old = batch["old_values"].to(values)
            clipped = (old + (predicted - old).clamp(-self.value_clip, self.value_clip) - returns) ** 2
            per_token, clipped_more = torch.maximum(unclipped, clipped), (clipped > unclipped).to(values)
        count = global_valid_toks.to(values).clamp(min=1)
        loss = 0.5 * (per_token * mask).sum() / count
        with torch.no_grad():
            metrics = {
                "loss": loss.item(),
                "value_clip_fraction": ((clipped_more * mask).sum() / count).item(),
                "values_mean": ((predicted * mask).sum() / count).item(),
            }
        return loss, metrics
