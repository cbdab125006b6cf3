"""The on-policy distillation loss: per-token KL between the teacher's and the student's
next-token distributions, seen through the teacher's top-k tokens, token-level.

At each position ``t`` of a generated token (mask ``m = token_mask * sample_mask``), with the
teacher's top-k token ids (``topk_indices`` [b, S-1, k]: index ``t - 1`` predicts token ``t``,
as :meth:`~posttrain.interfaces.Policy.get_topk_logits` lays them out):

- ``u = teacher_topk_logprobs`` [k], the teacher's logprobs of those ids (normalised over its
  whole vocabulary, at the logprob temperature), and ``s`` [k], the student's (its
  ``topk_logprobs`` input, computed in its workers);
- each distribution is reduced to k + 1 outcomes, the k tokens and "any other token", whose
  probability is the rest: ``p = exp(s)``, ``p_rest = 1 - sum(p)``, ``q = exp(u)``,
  ``q_rest = 1 - sum(q)`` (each rest at least :data:`REST_FLOOR`, so its logarithm is finite).

Per token: ``reverse = sum p (s - u) + p_rest log(p_rest / q_rest)`` (KL(student || teacher)
on those outcomes: the student pays for mass it puts where the teacher puts little, including
outside the teacher's top-k); ``forward = sum q (u - s) + q_rest log(q_rest / p_rest)``;
``mixed = w * forward + (1 - w) * reverse``. The loss is ``sum_{i,t} m * kl / global_valid_toks``.
Both KLs are at least 0, and 0 when the two models agree on the k tokens.

Metrics (same normalisation): ``loss``, ``reverse_kl``, ``forward_kl``, ``topk_mass`` and
``teacher_topk_mass`` (each model's probability of the teacher's top-k tokens).
"""

from __future__ import annotations

import torch

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType

KL_KINDS = ("reverse", "forward", "mixed")
#: The smallest probability "any other token" is given (its logarithm stays finite).
REST_FLOOR = 1e-6


def _rest(logprobs: torch.Tensor) -> torch.Tensor:
    """``1 - sum(exp(logprobs))`` over the last dimension, at least :data:`REST_FLOOR`."""
    return (1 - logprobs.exp().sum(-1)).clamp(min=REST_FLOOR)


class DistillationLoss(LossFunction):
    """Top-k KL to a teacher (module docstring)."""

    loss_type = LossType.TOKEN
    input_type = "topk_logprobs"

    def __init__(self, kl: str = "reverse", forward_weight: float = 0.5):
        if kl not in KL_KINDS:
            raise ValueError(f"kl must be one of {', '.join(KL_KINDS)}, got '{kl}'")
        if not 0.0 <= forward_weight <= 1.0:
            raise ValueError(f"forward_weight must be in [0, 1], got {forward_weight}")
        self.kl = kl
        self.forward_weight = forward_weight

    def __call__(
        self,
        topk_logprobs: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if "teacher_topk_logprobs" not in batch:
            raise ValueError("distillation needs the batch's 'teacher_topk_logprobs' (the teacher's top-k pass)")
        mask = batch["token_mask"].to(topk_logprobs) * batch["sample_mask"].to(topk_logprobs)[:, None]
        valid = (mask > 0)[..., None]
        # the teacher's values at t - 1 predict token t: shift them onto the logprob convention
        teacher = torch.nn.functional.pad(batch["teacher_topk_logprobs"].to(topk_logprobs), (0, 0, 1, 0))
        u = torch.where(valid, teacher, 0.0)
        s = torch.where(valid, topk_logprobs, 0.0)
        p_rest, q_rest = _rest(s), _rest(u)
        reverse = (s.exp() * (s - u)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
        forward = (u.exp() * (u - s)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())
        count = global_valid_toks.to(topk_logprobs).clamp(min=1)

        def total(per_token: torch.Tensor) -> torch.Tensor:
            return (per_token * mask).sum() / count

        if self.kl == "reverse":
            per_token = reverse
        elif self.kl == "forward":
            per_token = forward
        else:
            per_token = self.forward_weight * forward + (1 - self.forward_weight) * reverse
        loss = total(per_token)
        with torch.no_grad():
            metrics = {
                "loss": loss.item(),
                "reverse_kl": total(reverse).item(),
                "forward_kl": total(forward).item(),
                "topk_mass": total(s.exp().sum(-1)).item(),
                "teacher_topk_mass": total(u.exp().sum(-1)).item(),
            }
        return loss, metrics
