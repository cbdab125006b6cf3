"""The generation engine's logprobs in :class:`~posttrain_grpo.loss.ClippedPGLoss`: the
train/inference importance weights, what a non-finite engine logprob does, and the
mismatch diagnostics.

Per valid token, ``d = prev - gen``: the log of the weight ``w = p_prev / p_gen`` that takes
an expectation over the engine's samples to one over the proximal policy's.

Weights (``importance_sampling_correction``; ``low = is_min or 0``, ``high = is_max``):

- ``tis``: ``clip(w, low, high)``; ``icepop``: ``w``, or 0 outside ``[low, high]``;
- ``seq_mask_tis``: ``w``, or 0 on every token of a sequence whose geometric mean
  ``exp(mean_t d)`` is outside ``[low, high]``;
- ``sequence_truncate``: every token of a sequence weighs ``clip(W, low, high)`` with the
  product ``W = exp(sum_t d)``; ``sequence_mask``: ``W``, or 0 outside ``[low, high]``;
- with GSPO's ``sequence_level_ratio``, ``w`` is the sequence's weight for every token: its
  geometric mean ``exp(mean_t d)`` or its product ``exp(sum_t d)`` (``sequence_is_weight``).

A token whose ``d`` is not finite (the engine reported NaN or an infinite logprob):
``drop_sequence`` weighs its whole sequence 0; ``drop_token`` weighs it 0 and counts its
``d`` as 0 in its sequence's aggregate; ``neutral_token`` sets its ``d`` to 0 (weight 1).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from posttrain_grpo.config import ClippedPGConfig, NonfiniteGeneration
from posttrain_grpo.reduction import Reduction

#: The reduction of 1 over the tokens the mismatch metrics cover (see :func:`mismatch_metrics`).
MISMATCH_SHARE = "mismatch/share"
#: Bound on a log-ratio or log-ratio sum before a diagnostic exponentiates it.
DIAGNOSTIC_LOG_BOUND = 20.0


def generation_log_ratio(
    prev: torch.Tensor, gen: torch.Tensor, reduce: Reduction, handling: NonfiniteGeneration
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d, keep, bad)``, each [b, S]: ``d = prev - gen`` on valid tokens (0 elsewhere and
    where not finite), ``keep`` 1.0 or 0.0 per token by ``handling``, and ``bad`` where the
    raw ``d`` was not finite on a valid token."""
    raw = torch.where(reduce.valid, prev - gen, 0.0).detach()
    bad = reduce.valid & ~torch.isfinite(raw)
    d = torch.where(bad, 0.0, raw)
    if handling == "drop_sequence":
        keep = (~bad.any(dim=1, keepdim=True)).expand_as(bad)
    elif handling == "drop_token":
        keep = ~bad
    else:  # neutral_token
        keep = torch.ones_like(bad)
    return d, keep.to(d.dtype), bad


def importance_weights(
    cfg: ClippedPGConfig,
    d: torch.Tensor,
    keep: torch.Tensor,
    reduce: Reduction,
    metrics: MutableMapping[str, torch.Tensor | float],
) -> torch.Tensor:
    """Detached per-token weights [b, S] of ``cfg.importance_sampling_correction`` (module
    docstring), times ``keep``; their metrics go into ``metrics``."""
    kind = cfg.importance_sampling_correction
    low = cfg.is_min if cfg.is_min is not None else 0.0
    high = cfg.is_max
    assert high is not None, "the loss config check requires is_max with a correction"
    if kind in ("sequence_truncate", "sequence_mask"):
        log_w = reduce.sequence_sum(d)[:, None].expand_as(d)
    elif cfg.sequence_level_ratio:
        aggregate = reduce.sequence_sum if cfg.sequence_is_weight == "product" else reduce.sequence_mean
        log_w = aggregate(d)[:, None].expand_as(d)
    else:
        log_w = d
    raw = torch.exp(log_w)
    if kind == "seq_mask_tis":
        geo_mean = torch.exp(reduce.sequence_mean(d))[:, None].expand_as(d)
        out_of_bounds = (geo_mean < low) | (geo_mean > high)
    else:
        out_of_bounds = (raw < low) | (raw > high)
    if kind in ("tis", "sequence_truncate"):
        weights = raw.clamp(low, high)
    else:  # icepop, seq_mask_tis, sequence_mask: drop what is out of bounds, keep the raw weight elsewhere
        weights = torch.where(out_of_bounds, 0.0, raw)
    weights = weights * keep
    metrics["is_weight_mean"] = reduce.metric(weights)
    metrics["is_weight_max"] = reduce.extreme(weights, "max")
    metrics["is_oob_fraction"] = reduce.metric(out_of_bounds)
    return weights


def mismatch_metrics(
    prev: torch.Tensor, gen: torch.Tensor, current: torch.Tensor, reduce: Reduction
) -> dict[str, torch.Tensor]:
    """How far the engine's logprobs ``gen`` are from the trainer's ``prev`` (both [b, S],
    detached), and the current policy's entropy estimate from ``current``:

    - ``token_mult_prob_error``: mean of ``exp(|d|)`` (1 when the two agree);
    - ``mismatch_kl``: mean of ``e^d - 1 - d``, the k3 estimate of KL(engine || trainer);
    - ``mismatch_chi2_token``: mean of ``w^2`` minus 1, ``w = e^d``: the chi-square
      divergence of the token weights, their variance;
    - ``mismatch_chi2_sequence``: mean over sequences of ``W^2 - 1``, ``W = exp(sum_t d)``;
    - ``mismatch_ppl_ratio``: mean over sequences of the trainer's perplexity over the
      engine's, ``exp(-mean_t d)``;
    - ``approx_entropy``: mean of ``-exp(current - gen) current``, the current policy's
      entropy at the visited states (tokens were drawn from the engine's policy).

    Token means are reduced like the loss's metrics; the chi-square terms bound their
    log-ratios (sums) to +-20 first; ``mismatch_kl`` is computed in float64 (the k3 of a
    float32 rounding gap, about 1e-14, cancels to 0 in float32). Non-finite engine logprobs
    give non-finite values. ``mismatch/share`` is the reduction of 1 (its sum over a pass is 1
    up to rounding): :func:`posttrain_grpo.mismatch_buckets.mismatch_means` divides
    ``token_mult_prob_error`` by it, so that identical logprobs give exactly 1 whatever the
    microbatches.
    """
    d = torch.where(reduce.valid, prev - gen, 0.0)
    wide = d.double()
    bounded = d.clamp(-DIAGNOSTIC_LOG_BOUND, DIAGNOSTIC_LOG_BOUND)
    sequence_sum = reduce.sequence_sum(d).clamp(-DIAGNOSTIC_LOG_BOUND, DIAGNOSTIC_LOG_BOUND)
    return {
        "token_mult_prob_error": reduce.metric(torch.exp(d.abs())),
        MISMATCH_SHARE: reduce.metric(torch.ones_like(d)),
        "mismatch_kl": reduce.metric(torch.exp(wide) - 1 - wide),
        "mismatch_chi2_token": reduce.metric(torch.exp(2 * bounded) - 1),
        "mismatch_chi2_sequence": reduce.per_sequence(torch.exp(2 * sequence_sum) - 1),
        "mismatch_ppl_ratio": reduce.per_sequence(torch.exp(-reduce.sequence_mean(d))),
        "approx_entropy": reduce.metric(-torch.exp(current - gen) * current),
    }
