"""The Bradley-Terry loss of a reward model, sequence-level, over a value head's outputs.

Rows come in pairs: chosen at even rows, rejected at odd rows (as the ``preference`` dataset
collates them). A row's score is its value at its last token, ``r = values[length - 1]`` (the
position a Hugging Face sequence classifier pools). Per pair, with ``h = r_chosen - r_rejected``:

``loss = -log sigmoid(h)`` (+ ``c * (r_chosen + r_rejected)**2`` with
``center_rewards_coefficient`` c), which is TRL's ``RewardTrainer`` loss.

A microbatch returns ``sum_pairs pair_mask * loss_pair / P`` with ``P`` = global valid
sequences / 2 (the global number of pairs) and ``pair_mask`` 1 when both rows have
``sample_mask`` 1, so the microbatch losses sum to the mean over all pairs. Metrics are
contributions on the same scale: ``accuracy`` (share of pairs with ``r_chosen > r_rejected``),
``margin`` (mean ``h``), ``rewards_chosen``, ``rewards_rejected``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType, check_pair_rows


def sequence_scores(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's value at its last token: ``values[i, lengths[i] - 1]`` ([B] from [B, S])."""
    return values.gather(1, (lengths.to(values.device) - 1).clamp(min=0)[:, None])[:, 0]


class BradleyTerryLoss(LossFunction):
    """Pairwise preference loss on sequence scores (module docstring)."""

    loss_type = LossType.SEQUENCE
    input_type = "values"
    row_group_size = 2  # a chosen row and its rejected row are scored together

    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center_rewards_coefficient = center_rewards_coefficient

    @classmethod
    def from_options(cls, options: Any) -> BradleyTerryLoss:
        """The registry factory: ``options`` is the ``rm`` section (:class:`~posttrain_rm.config.RMConfig`)."""
        return cls(options.center_rewards_coefficient)

    def __call__(
        self,
        values: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_pair_rows(values.shape[0], "a reward model trains on")
        scores = sequence_scores(values, batch["input_lengths"])
        chosen, rejected = scores[0::2], scores[1::2]
        sample_mask = batch["sample_mask"].to(values)
        pair_mask = sample_mask[0::2] * sample_mask[1::2]
        num_pairs = (global_valid_seqs.to(values) / 2).clamp(min=1)

        def mean(per_pair: torch.Tensor) -> torch.Tensor:  # contribution to the mean over all pairs
            return (per_pair * pair_mask).sum() / num_pairs

        margin = chosen - rejected
        per_pair = -F.logsigmoid(margin)
        if self.center_rewards_coefficient is not None:
            per_pair = per_pair + self.center_rewards_coefficient * (chosen + rejected) ** 2
        loss = mean(per_pair)
        with torch.no_grad():
            metrics = {
                "loss": loss.item(),
                "accuracy": mean((chosen > rejected).to(values)).item(),
                "margin": mean(margin).item(),
                "rewards_chosen": mean(chosen).item(),
                "rewards_rejected": mean(rejected).item(),
            }
        return loss, metrics
