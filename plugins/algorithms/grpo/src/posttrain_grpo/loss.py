"""The clipped policy-gradient loss of GRPO (PPO's objective with group advantages) and its
variants: asymmetric and dual clipping, GSPO's sequence-level ratio, REINFORCE without a
ratio, a KL penalty to the reference policy, and train/inference importance-sampling
correction.

Per valid token t of sample i (mask ``m = token_mask * sample_mask``), with ``A`` the
advantage, ``r = exp(logp - prev_logprobs)`` (GSPO: ``exp`` of the sequence's mean log-ratio;
without a ``prev_logprobs`` field, on policy, ``prev_logprobs = sg(logp)``, so ``r = 1`` with
the gradient of ``logp``):

- PPO: ``l = max(-A r, -A clip(r, 1 - ratio_clip_low, 1 + ratio_clip_high))``; dual clip
  (``dual_clip_c = c``): for ``A < 0``, ``l = min(l, -c A)``. REINFORCE: ``l = -A logp``.
- IS correction: ``l *= w`` with ``w = exp(prev_logprobs - generation_logprobs)`` (GSPO: the
  sequence's geometric mean, matching its length-normalised ratio), truncated per
  ``importance_sampling_correction``; ``w`` carries no gradient.
- metrics with ``generation_logprobs``: ``token_mult_prob_error`` (mean of
  ``exp(|prev - gen|)``) and ``mismatch_kl`` (``e^d - 1 - d`` with ``d = prev - gen``: the
  k3 estimate of KL(generation policy || trainer) on the sampled tokens).
- KL: ``beta * k(lr)`` with ``lr = clamp(reference_logprobs - logp, ±kl_input_clamp)``,
  ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = e^lr - 1 - lr``, clamped to ``±kl_output_clamp``,
  times ``exp(logp - sg(logp))``: 1 in value, it adds the score-function term so the
  gradient estimates the gradient of KL(pi || pi_ref) for samples drawn from the policy
  (for k3, ``logp - reference_logprobs`` per token). Where either clamp binds the token's
  estimate is a constant and carries no gradient at all, as in NeMo RL: the score-function
  term alone would be ``beta * clamp``, of the opposite sign to the unclamped gradient.

Reduction over the global batch: token-level ``sum_{i,t} m (l + KL) / global_valid_toks``;
sequence-level ``sum_i sample_mask_i * mean_t (l + KL) / global_valid_seqs`` (mean over the
sequence's ``token_mask``). Metrics are reduced the same way, so they sum over microbatches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch

from posttrain.batch import Batch
from posttrain.interfaces.loss import LossFunction, LossType
from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.validation import check_loss_config


class _Reduction:
    """Normalises per-token values [b, S] like the loss (see the module docstring)."""

    def __init__(
        self, batch: Batch, like: torch.Tensor, token_level: bool, valid_seqs: torch.Tensor, valid_toks: torch.Tensor
    ):
        self.token_mask = batch["token_mask"].to(like.dtype)
        self.sample_mask = batch["sample_mask"].to(like.dtype)
        self.valid = (self.token_mask * self.sample_mask[:, None]) > 0
        self.token_level = token_level
        count = torch.as_tensor(valid_toks if token_level else valid_seqs, dtype=like.dtype, device=like.device)
        self.count = torch.where(count > 0, count, torch.ones_like(count))  # an empty global batch gives 0, not NaN

    def sequence_mean(self, x: torch.Tensor) -> torch.Tensor:
        """[b]: each sequence's mean over its ``token_mask`` (0 for a sequence without tokens)."""
        n = self.token_mask.sum(dim=1)
        return (torch.where(self.valid, x, 0.0) * self.token_mask).sum(dim=1) / torch.where(n > 0, n, 1.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.token_mask.dtype)
        if self.token_level:
            masked = torch.where(self.valid, x, 0.0) * self.token_mask * self.sample_mask[:, None]
            return masked.sum() / self.count
        return (self.sample_mask * self.sequence_mean(x)).sum() / self.count

    def extreme(self, x: torch.Tensor, kind: Literal["max", "min"]) -> float:
        """Max or min over valid tokens; -inf / +inf when there are none."""
        values = x.detach()[self.valid]
        if values.numel() == 0:
            return float("-inf") if kind == "max" else float("inf")
        return float(values.max() if kind == "max" else values.min())


class ClippedPGLoss(LossFunction):
    """GRPO's policy loss; options in :class:`~posttrain_grpo.config.ClippedPGConfig`.

    Batch fields: ``token_mask`` [b, S], ``sample_mask`` [b], ``advantages`` [b] or [b, S],
    ``prev_logprobs`` [b, S] (absent: on policy, the logprobs being trained, detached);
    ``generation_logprobs`` [b, S] with IS correction (otherwise optional, for mismatch
    metrics); ``reference_logprobs`` [b, S] when ``kl_penalty > 0`` (otherwise optional,
    for the ``kl`` metric).
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
        reduce = _Reduction(batch, logprobs, cfg.token_level_loss, global_valid_seqs, global_valid_toks)
        logp = torch.where(reduce.valid, logprobs, 0.0)  # no inf/NaN from padding reaches the graph
        if "prev_logprobs" in batch:
            prev = torch.where(reduce.valid, batch["prev_logprobs"].to(logp.dtype), 0.0)
        else:  # on policy: the logprobs being trained
            prev = logp.detach()
        adv = _per_token(batch["advantages"], logp)
        metrics: dict[str, torch.Tensor | float] = {}

        log_ratio = logp - prev
        if cfg.sequence_level_ratio:
            log_ratio = reduce.sequence_mean(log_ratio)[:, None].expand_as(logp)
        ratio = torch.exp(log_ratio)
        if cfg.disable_ppo_ratio:
            per_token = -adv * logp
        else:
            per_token = self._clipped_objective(ratio, adv, reduce, metrics)
        if cfg.importance_sampling_correction is not None:
            per_token = per_token * self._importance_weights(batch, prev, reduce, metrics)
        pg_loss = reduce(per_token)
        loss = pg_loss

        if cfg.kl_penalty > 0 or "reference_logprobs" in batch:
            kl, clamped = self._kl_estimate(batch["reference_logprobs"].to(logp.dtype), logp, reduce)
            kl_value = reduce(kl.detach())
            metrics["kl"] = kl_value
            metrics["kl_penalty"] = cfg.kl_penalty * kl_value
            if cfg.kl_penalty > 0:
                with_score = kl * torch.exp(logp - logp.detach())
                loss = loss + cfg.kl_penalty * reduce(torch.where(clamped, kl, with_score))

        if "generation_logprobs" in batch:
            gen = torch.where(reduce.valid, batch["generation_logprobs"].to(logp.dtype), 0.0)
            metrics["token_mult_prob_error"] = reduce(torch.exp((prev - gen).abs()))
            # KL(generation policy || trainer) at the sampled tokens, k3 estimator: >= 0, 0 when
            # the two agree (on policy up to numerics; off policy it grows with staleness).
            log_ratio = (prev - gen).detach()
            metrics["mismatch_kl"] = reduce(torch.exp(log_ratio) - 1 - log_ratio)
            # Monte Carlo estimate of the current policy's per-token entropy at the visited
            # states: tokens were drawn from the generation policy, so -log p(x_t) is weighted
            # by p(x_t) / p_gen(x_t).
            current = logp.detach()
            metrics["approx_entropy"] = reduce(-torch.exp(current - gen) * current)

        metrics.update(
            loss=loss,
            pg_loss=pg_loss,
            ratio_mean=reduce(ratio.detach()),
            ratio_min=reduce.extreme(ratio, "min"),
            ratio_max=reduce.extreme(ratio, "max"),
        )
        return loss, {name: _scalar(value) for name, value in metrics.items()}

    def _clipped_objective(
        self, ratio: torch.Tensor, adv: torch.Tensor, reduce: _Reduction, metrics: dict
    ) -> torch.Tensor:
        low, high = 1 - self.config.ratio_clip_low, 1 + self.config.ratio_clip_high
        objective = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
        metrics["clip_fraction_low"] = reduce((adv < 0) & (ratio < low))
        metrics["clip_fraction_high"] = reduce((adv > 0) & (ratio > high))
        c = self.config.dual_clip_c
        if c is None:
            return objective
        bound = -c * adv
        binds = (adv < 0) & (objective > bound)
        metrics["dual_clip_fraction"] = reduce(binds)
        return torch.where(binds, bound, objective)

    def _importance_weights(self, batch: Batch, prev: torch.Tensor, reduce: _Reduction, metrics: dict) -> torch.Tensor:
        """Detached per-token weights exp(prev - generation), truncated per the config."""
        cfg = self.config
        gen = torch.where(reduce.valid, batch["generation_logprobs"].to(prev.dtype), 0.0)
        log_w = (prev - gen).detach()
        if cfg.sequence_level_ratio:
            log_w = reduce.sequence_mean(log_w)[:, None].expand_as(prev)
        raw = torch.exp(log_w)
        low = cfg.is_min if cfg.is_min is not None else 0.0
        high = cfg.is_max
        if cfg.importance_sampling_correction == "seq_mask_tis":
            geo_mean = torch.exp(reduce.sequence_mean(log_w))[:, None].expand_as(prev)
            out_of_bounds = (geo_mean < low) | (geo_mean > high)
        else:
            out_of_bounds = (raw < low) | (raw > high)
        if cfg.importance_sampling_correction == "tis":
            weights = raw.clamp(low, high)
        else:  # icepop, seq_mask_tis: drop what is out of bounds, keep the raw weight elsewhere
            weights = torch.where(out_of_bounds, 0.0, raw)
        weights = torch.where(torch.isfinite(weights), weights, 0.0)
        metrics["is_weight_mean"] = reduce(weights)
        metrics["is_weight_max"] = reduce.extreme(weights, "max")
        metrics["is_oob_fraction"] = reduce(out_of_bounds)
        return weights

    def _kl_estimate(
        self, reference: torch.Tensor, logp: torch.Tensor, reduce: _Reduction
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs, and where
        a clamp binds (there the estimate is a constant of ``logp``)."""
        cfg = self.config
        log_ratio = torch.where(reduce.valid, reference - logp, 0.0)
        clamped = torch.zeros_like(log_ratio, dtype=torch.bool)
        if cfg.kl_input_clamp is not None:
            clamped = log_ratio.detach().abs() > cfg.kl_input_clamp
            log_ratio = log_ratio.clamp(-cfg.kl_input_clamp, cfg.kl_input_clamp)
        if cfg.kl_estimator == "k1":
            kl = -log_ratio
        elif cfg.kl_estimator == "k2":
            kl = log_ratio.square() / 2
        else:
            kl = torch.exp(log_ratio) - 1 - log_ratio
        if cfg.kl_output_clamp is not None:
            clamped = clamped | (kl.detach().abs() > cfg.kl_output_clamp)
            kl = kl.clamp(-cfg.kl_output_clamp, cfg.kl_output_clamp)
        return kl, clamped


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
