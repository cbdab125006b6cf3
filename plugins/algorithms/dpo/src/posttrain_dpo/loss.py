"""Direct preference optimisation losses, sequence-level: sigmoid DPO and the loss types of
TRL's ``DPOTrainer`` (IPO, hinge, robust, BCO pair, APO, SPPO) and an SFT-only loss.

Rows come in pairs: chosen at even rows, rejected at odd rows (as the ``preference``
dataset collates them). With ``m = token_mask * sample_mask`` per row:

- sequence logprob ``s = sum_t m_t * logprobs_t``, and ``s_ref`` the same over the batch's
  ``reference_logprobs`` (0 when ``reference_free``); with ``average_log_probs`` both are
  divided by the row's loss-token count ``n = sum_t m_t``;
- log-ratios ``c = s_chosen - s_ref_chosen``, ``r = s_rejected - s_ref_rejected``; margin
  ``h = c - r``; ``eps`` is ``label_smoothing``; per pair:

  - ``sigmoid``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (``eps`` 0 is
    standard DPO; ``h = 0`` gives ``ln 2``; eps > 0 is conservative DPO);
  - ``ipo``: ``(h - 1 / (2 beta))^2``;
  - ``hinge``: ``max(0, 1 - beta h)``;
  - ``robust``: ``((1 - eps)(-log sigmoid(beta h)) - eps (-log sigmoid(-beta h))) / (1 - 2 eps)``;
  - ``bco_pair``: ``-log sigmoid(beta c) - log sigmoid(-beta r)``;
  - ``apo_zero``: ``1 - sigmoid(beta c) + sigmoid(beta r)``;
  - ``apo_down``: ``sigmoid(beta c) + 1 - sigmoid(beta h)``;
  - ``sppo_hard``: ``(c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2``;
  - ``sft``: 0, the loss is the SFT term alone, with weight 1 (no reference needed);

- with ``sft_weight`` w > 0, ``w * NLL`` is added, the chosen response's NLL per
  ``sft_reduction``: ``mean`` ``-s_chosen / n_chosen`` (per token, so w means the same at
  any length) or ``sum`` ``-s_chosen`` (NeMo RL's default).

A microbatch returns ``sum_pairs pair_mask * loss_pair / P`` where ``P`` = global valid
sequences / 2 (the global number of pairs) and ``pair_mask`` is 1 when both rows have
``sample_mask`` 1, so the microbatch losses sum to the mean over all pairs. Metrics are
contributions on the same scale: rewards are ``beta * c`` and ``beta * r``, accuracy is the
share of pairs with ``c > r``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType, check_pair_rows
from posttrain_dpo.config import LOSS_TYPES, SFT_REDUCTIONS


def pair_losses(
    kind: str, beta: float, chosen: torch.Tensor, rejected: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-pair preference loss of ``kind`` from the chosen and rejected log-ratios (module
    docstring); 0 for ``sft``."""
    margin = chosen - rejected
    eps = label_smoothing
    if kind == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    if kind == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return torch.relu(1 - beta * margin)
    if kind == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if kind == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * margin)
    if kind == "sppo_hard":
        return (chosen - 1 / (2 * beta)) ** 2 + (rejected + 1 / (2 * beta)) ** 2
    if kind == "sft":
        return torch.zeros_like(margin)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got '{kind}'")


class DPOLoss(LossFunction):
    """Sequence-level preference loss over interleaved chosen/rejected rows (module docstring)."""

    loss_type = LossType.SEQUENCE
    row_group_size = 2  # a chosen row and its rejected row are scored together

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        *,
        reference_free: bool = False,
        average_log_probs: bool = False,
        sft_weight: float = 0.0,
        label_smoothing: float = 0.0,
        sft_reduction: str = "mean",
    ):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got '{loss_type}'")
        if sft_reduction not in SFT_REDUCTIONS:
            raise ValueError(f"sft_reduction must be one of {', '.join(SFT_REDUCTIONS)}, got '{sft_reduction}'")
        self.beta = beta
        self.kind = loss_type
        self.reference_free = reference_free
        self.average_log_probs = average_log_probs
        self.sft_weight = 1.0 if loss_type == "sft" else sft_weight
        self.label_smoothing = label_smoothing
        self.sft_reduction = sft_reduction

    @property
    def needs_reference(self) -> bool:
        """Whether the batch must hold ``reference_logprobs`` (not for ``reference_free``,
        nor for the ``sft`` loss type, whose reward metrics then use a reference of 0)."""
        return not self.reference_free and self.kind != "sft"

    @classmethod
    def from_options(cls, options: Any) -> DPOLoss:
        """The registry factory: ``options`` is the ``dpo`` section (:class:`DPOConfig`)."""
        return cls(
            options.beta,
            options.loss_type,
            reference_free=options.reference_free,
            average_log_probs=options.average_log_probs,
            sft_weight=options.sft_weight,
            label_smoothing=options.label_smoothing,
            sft_reduction=options.sft_reduction,
        )

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_pair_rows(logprobs.shape[0], "DPO needs")
        if self.needs_reference and "reference_logprobs" not in batch:
            raise ValueError(
                "DPO needs the batch's 'reference_logprobs' (from policy.get_reference_policy_logprobs) "
                "unless dpo.reference_free is true"
            )
        sample_mask = batch["sample_mask"].to(logprobs)
        mask = batch["token_mask"].to(logprobs) * sample_mask[:, None]
        num_tokens = mask.sum(-1)
        summed = _masked_sum(logprobs, mask)
        policy_logp = summed
        reference_logp = (
            _masked_sum(batch["reference_logprobs"].to(logprobs), mask)
            if not self.reference_free and "reference_logprobs" in batch else torch.zeros_like(policy_logp)
        )
        if self.average_log_probs:
            policy_logp = policy_logp / num_tokens.clamp(min=1)
            reference_logp = reference_logp / num_tokens.clamp(min=1)
        logratio = policy_logp - reference_logp
        chosen, rejected = logratio[0::2], logratio[1::2]
        pair_mask = sample_mask[0::2] * sample_mask[1::2]
        num_pairs = (global_valid_seqs.to(logprobs) / 2).clamp(min=1)

        def mean(per_pair: torch.Tensor) -> torch.Tensor:  # contribution to the mean over all pairs
            return (per_pair * pair_mask).sum() / num_pairs

        margin = chosen - rejected
        preference_loss = mean(pair_losses(self.kind, self.beta, chosen, rejected, self.label_smoothing))
        loss = preference_loss
        metrics: dict[str, float] = {"preference_loss": preference_loss.item()}
        if self.sft_weight:
            chosen_nll = -summed[0::2]
            if self.sft_reduction == "mean":
                chosen_nll = chosen_nll / num_tokens[0::2].clamp(min=1)
            sft_loss = mean(chosen_nll)
            loss = loss + self.sft_weight * sft_loss
            metrics["sft_loss"] = sft_loss.item()
        with torch.no_grad():
            metrics.update(
                loss=loss.item(),
                accuracy=mean((chosen > rejected).to(logprobs)).item(),
                rewards_chosen=mean(self.beta * chosen).item(),
                rewards_rejected=mean(self.beta * rejected).item(),
                reward_margin=mean(self.beta * margin).item(),
                logps_chosen=mean(policy_logp[0::2]).item(),
                logps_rejected=mean(policy_logp[1::2]).item(),
            )
        return loss, metrics


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row ``sum_t mask * values``, with masked positions exactly 0 even where values are -inf."""
    return (torch.where(mask != 0, values, torch.zeros_like(values)) * mask).sum(-1)
