"""The clipped policy-gradient loss of GRPO (PPO's objective with group advantages) and its
variants: asymmetric and dual clipping, CISPO, SAPO, GSPO's sequence-level ratio, REINFORCE
without a ratio, a KL penalty to the reference policy (in the loss or in the advantages),
train/inference importance-sampling correction, and the normalisers of Dr. GRPO and TRL's
``bnpo``. Every option's formula, with the NeMo RL and TRL option it corresponds to:
docs/algorithms/loss-reference.md.

Per valid token t of sample i (mask ``m = token_mask * sample_mask``), with ``A`` the
advantage and ``r`` the ratio to the proximal policy ``prev`` (:mod:`posttrain_grpo.objectives`):

- ``prev`` is the batch's ``prev_logprobs``, or without that field, on policy, the logprobs
  being trained, detached (``r = 1`` with the gradient of ``logp``); with
  ``rollout_correction: bypass`` it is the engine's ``generation_logprobs``;
- ``l`` is the objective's per-token loss (:mod:`posttrain_grpo.objectives`), with ``A``
  less the KL shift under ``kl_in_reward`` (:mod:`posttrain_grpo.kl`), times the detached
  importance weight of ``importance_sampling_correction`` (:mod:`posttrain_grpo.importance`);
- the KL term (:mod:`posttrain_grpo.kl`) is added per token when ``kl_penalty > 0``.

Reduction over the global batch (:mod:`posttrain_grpo.reduction`): token-level
``sum_{i,t} m (l + KL) / N`` with ``N`` per ``token_normalizer``; sequence-level
``sum_i sample_mask_i * mean_t (l + KL) / global_valid_seqs``. Metrics are global means over
tokens (token-level) or sequences, so they sum over microbatches. With the engine's logprobs, the
mismatch metrics (:mod:`posttrain_grpo.importance`) come per turn, position bucket and staleness
too (:mod:`posttrain_grpo.mismatch_buckets`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType
from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.importance import generation_log_ratio, importance_weights, mismatch_metrics
from posttrain_grpo.kl import kl_loss_term, kl_reward_shift
from posttrain_grpo.mismatch_buckets import bucket_sums
from posttrain_grpo.objectives import policy_objective, policy_ratio
from posttrain_grpo.reduction import Reduction
from posttrain_grpo.validation import check_loss_config


class ClippedPGLoss(LossFunction):
    """GRPO's policy loss; options in :class:`~posttrain_grpo.config.ClippedPGConfig`.

    Batch fields: ``token_mask`` [b, S], ``sample_mask`` [b], ``advantages`` [b] or [b, S],
    ``prev_logprobs`` [b, S] (absent: on policy, the logprobs being trained, detached);
    ``generation_logprobs`` [b, S] with IS correction, ``rollout_correction: bypass`` or
    ``kl_importance_weight: generation`` (otherwise optional, for mismatch metrics);
    ``reference_logprobs`` [b, S] when ``kl_penalty > 0`` (otherwise optional, for the
    ``kl`` metric).
    """

    metric_reductions: ClassVar[Mapping[str, Literal["max", "min"]]] = {
        "ratio_min": "min",
        "ratio_max": "max",
        "is_weight_max": "max",
    }

    def __init__(self, config: ClippedPGConfig):
        check_loss_config(config, "grpo.loss")
        self.config = config
        self.loss_type = LossType.TOKEN if config.token_level_loss else LossType.SEQUENCE

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        reduce = Reduction(
            batch, logprobs, global_valid_seqs, global_valid_toks,
            token_level=cfg.token_level_loss, normalizer=cfg.token_normalizer, constant=cfg.constant_normalizer,
        )
        logp = torch.where(reduce.valid, logprobs, 0.0)  # no inf/NaN from padding reaches the graph
        if "prev_logprobs" in batch and cfg.rollout_correction == "decoupled":
            prev = torch.where(reduce.valid, batch["prev_logprobs"].to(logp.dtype), 0.0)
        else:  # on policy (or bypass, for the metrics): the logprobs being trained
            prev = logp.detach()
        gen = _generation_logprobs(cfg, batch, reduce, logp.dtype)
        metrics: dict[str, torch.Tensor | float] = {}

        anchor = prev
        if gen is not None:
            d, keep, bad = generation_log_ratio(prev, gen, reduce, cfg.nonfinite_generation_logprobs)
            if cfg.rollout_correction == "bypass":  # a token the engine could not score gets r = 1
                anchor = torch.where(bad, logp.detach(), gen)
        adv = _per_token(batch["advantages"], logp)
        if cfg.kl_in_reward is not None:
            adv = adv - kl_reward_shift(cfg, batch["reference_logprobs"].to(logp.dtype), prev, reduce)

        ratio = policy_ratio(cfg, logp, anchor, reduce)
        per_token = policy_objective(cfg, logp, ratio, adv, reduce, metrics)
        if cfg.importance_sampling_correction is not None:
            per_token = per_token * importance_weights(cfg, d, keep, reduce, metrics)
        elif cfg.rollout_correction == "bypass":
            per_token = torch.where(keep > 0, per_token, 0.0)
        pg_loss = reduce.loss(per_token)
        loss = pg_loss

        if cfg.kl_penalty > 0 or "reference_logprobs" in batch:
            term = kl_loss_term(cfg, batch["reference_logprobs"].to(logp.dtype), logp, ratio, gen, reduce)
            kl_value = reduce.metric(term.detach())
            metrics["kl"] = kl_value
            metrics["kl_penalty"] = cfg.kl_penalty * kl_value
            if cfg.kl_penalty > 0 and cfg.kl_in_reward is None:
                loss = loss + cfg.kl_penalty * reduce.loss(term)

        if gen is not None:
            metrics.update(mismatch_metrics(prev, gen, logp.detach(), reduce))
            metrics.update(bucket_sums(prev, gen, reduce, batch))

        metrics.update(
            loss=loss,
            pg_loss=pg_loss,
            ratio_mean=reduce.metric(ratio.detach()),
            ratio_min=reduce.extreme(ratio, "min"),
            ratio_max=reduce.extreme(ratio, "max"),
        )
        return loss, {name: _scalar(value) for name, value in metrics.items()}


def _generation_logprobs(cfg: ClippedPGConfig, batch: Batch, reduce: Reduction, dtype: torch.dtype) -> torch.Tensor | None:
    """The batch's ``generation_logprobs`` (0 off the valid tokens), or None without them;
    refuses a batch without them when the options need them."""
    if "generation_logprobs" in batch:
        return torch.where(reduce.valid, batch["generation_logprobs"].to(dtype), 0.0)
    for needs, option in (
        (cfg.importance_sampling_correction is not None, f"importance_sampling_correction={cfg.importance_sampling_correction}"),
        (cfg.rollout_correction == "bypass", "rollout_correction=bypass"),
        (cfg.kl_penalty > 0 and cfg.kl_importance_weight == "generation", "kl_importance_weight=generation"),
    ):
        if needs:
            raise ValueError(f"grpo.loss.{option} needs the batch's generation_logprobs")
    return None


def _scalar(value: torch.Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages [b] (one per sequence) or [b, S] (per token) as [b, S] in ``like``'s dtype."""
    advantages = advantages.to(like.dtype)
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages must be [b] or [b, S] = {tuple(like.shape)}, got {tuple(advantages.shape)}")
    return advantages
