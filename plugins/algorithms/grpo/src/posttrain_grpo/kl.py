"""The KL-to-reference penalty of :class:`~posttrain_grpo.loss.ClippedPGLoss`, in the loss
or in the advantages.

Per valid token, ``lr = clamp(reference - logp, +-kl_input_clamp)`` and the estimate of
KL(pi || pi_ref) is ``k1 = -lr``, ``k2 = lr^2 / 2`` or ``k3 = e^lr - 1 - lr``.

In the loss, the token's term is ``clamp(w k, +-kl_output_clamp)`` with the weight ``w`` of
``kl_importance_weight``: ``on_policy`` ``exp(logp - sg(logp))`` (1 in value; it adds the
score-function term, so the gradient estimates that of KL(pi || pi_ref) for tokens drawn from
pi: for k3, ``logp - reference`` per token), ``none`` 1 (the estimator's own gradient: for
k3, ``1 - e^lr``, the forward KL's in expectation), ``prev`` the policy ratio ``r``, and
``generation`` ``exp(logp - gen)`` (the tokens were drawn by the engine; a non-finite value
gives 0). Where either clamp binds the term is a constant and carries no gradient at all, as
in NeMo RL: the score-function term alone would have the opposite sign to the unclamped
gradient.

In the advantages (``kl_in_reward``), the estimate is taken at the proximal policy's
logprobs, detached, and the advantage of token t loses ``kl_penalty * k_t`` (``token``) or
``kl_penalty * sum_{s >= t} k_s`` over the sequence's valid tokens (``return_to_go``).
"""

from __future__ import annotations

import torch

from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.reduction import Reduction


def kl_estimate(
    cfg: ClippedPGConfig, reference: torch.Tensor, logp: torch.Tensor, reduce: Reduction
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token estimate [b, S] (with ``logp``'s gradient) and where the input clamp binds."""
    log_ratio = torch.where(reduce.valid, reference - logp, 0.0)
    bound = torch.zeros_like(log_ratio, dtype=torch.bool)
    if cfg.kl_input_clamp is not None:
        bound = log_ratio.detach().abs() > cfg.kl_input_clamp
        log_ratio = log_ratio.clamp(-cfg.kl_input_clamp, cfg.kl_input_clamp)
    if cfg.kl_estimator == "k1":
        return -log_ratio, bound
    if cfg.kl_estimator == "k2":
        return log_ratio.square() / 2, bound
    return torch.exp(log_ratio) - 1 - log_ratio, bound


def kl_loss_term(
    cfg: ClippedPGConfig,
    reference: torch.Tensor,
    logp: torch.Tensor,
    ratio: torch.Tensor,
    gen: torch.Tensor | None,
    reduce: Reduction,
) -> torch.Tensor:
    """The per-token KL term ``clamp(w k)`` [b, S] of the loss (module docstring)."""
    kl, bound = kl_estimate(cfg, reference, logp, reduce)
    form = cfg.kl_importance_weight
    if form == "on_policy":
        weight = torch.exp(logp - logp.detach())
    elif form == "none":
        weight = torch.ones_like(logp)
    elif form == "prev":
        weight = ratio
    else:  # generation
        if gen is None:
            raise ValueError("grpo.loss.kl_importance_weight=generation needs the batch's generation_logprobs")
        finite = torch.isfinite(gen)  # exp(-inf) = 0, and no inf reaches the backward pass
        weight = torch.exp(torch.where(finite, logp - torch.where(finite, gen, 0.0), -torch.inf))
    term = weight * kl
    if cfg.kl_output_clamp is not None:
        bound = bound | (term.detach().abs() > cfg.kl_output_clamp)
        term = term.clamp(-cfg.kl_output_clamp, cfg.kl_output_clamp)
    return torch.where(bound, term.detach(), term)


def kl_reward_shift(cfg: ClippedPGConfig, reference: torch.Tensor, prev: torch.Tensor, reduce: Reduction) -> torch.Tensor:
    """What ``kl_in_reward`` subtracts from each token's advantage, detached [b, S]."""
    kl, _ = kl_estimate(cfg, reference, prev.detach(), reduce)
    kl = torch.where(reduce.valid, kl, 0.0).detach()
    if cfg.kl_in_reward == "return_to_go":
        kl = kl.flip(1).cumsum(1).flip(1)
    return cfg.kl_penalty * kl
