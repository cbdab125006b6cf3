"""DPO's loss against NeMo RL's ``DPOLossFn`` and TRL's ``DPOTrainer`` loss types, in float64,
values and gradients, on pair batches with padding and a dropped pair, split into microbatches.

The references are written from each project's semantics with its own option names and
layout: NeMo RL interleaves chosen and rejected rows as posttrain does, adds 1e-8 to its mean
denominators (hence relative tolerances of 1e-7) and sums the SFT term by default; TRL stacks
the chosen rows before the rejected ones, sums logprobs over completion tokens and averages
each loss over the microbatch's pairs, dividing by the accumulation steps. (TRL's own code
runs in test_dpo_trl_parity.py, on a real model, for the values.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.batch import Batch
from posttrain_dpo.loss import DPOLoss

F64 = torch.float64
PAIRS, WIDTH = 6, 9


def pair_batch(seed: int, drop_pair: int | None = 2) -> tuple[torch.Tensor, Batch]:
    g = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    token_mask = torch.zeros(rows, WIDTH, dtype=F64)
    for i in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=g))
        stop = int(torch.randint(start + 1, WIDTH + 1, (1,), generator=g))
        token_mask[i, start:stop] = 1.0
    sample_mask = torch.ones(rows, dtype=F64)
    if drop_pair is not None:
        sample_mask[2 * drop_pair:2 * drop_pair + 2] = 0.0
    lp = -torch.rand(rows, WIDTH, generator=g, dtype=F64) * 2 * token_mask
    reference = -torch.rand(rows, WIDTH, generator=g, dtype=F64) * 2 * token_mask
    return lp.requires_grad_(), Batch(token_mask=token_mask, sample_mask=sample_mask, reference_logprobs=reference)


def counts(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["sample_mask"].sum(), (batch["token_mask"] * batch["sample_mask"][:, None]).sum()


def ours_split(options: dict, lp: torch.Tensor, batch: Batch, pairs_per_part: int) -> torch.Tensor:
    seqs, toks = counts(batch)
    loss_fn = DPOLoss(**options)
    rows = 2 * pairs_per_part
    return sum(loss_fn(lp[i:i + rows], batch.slice(i, i + rows), seqs, toks)[0] for i in range(0, 2 * PAIRS, rows))


# ----------------------------------------------------------------------------- NeMo RL


def nemo_dpo(cfg: dict, lp: torch.Tensor, data: Batch, global_valid_seqs: torch.Tensor) -> torch.Tensor:
    """NeMo RL's DPOLossFn on one microbatch (interleaved rows), in its option names."""
    token_mask, sample_mask = data["token_mask"], data["sample_mask"]
    pairs = global_valid_seqs / 2
    rewards = ((lp - data["reference_logprobs"]) * token_mask).sum(-1)
    if cfg.get("preference_average_log_probs"):
        rewards = rewards / token_mask.sum(-1).clamp(min=1)
    beta = cfg.get("reference_policy_kl_penalty", 0.05)
    chosen_mask = sample_mask[0::2]
    per_pair = -F.logsigmoid(beta * (rewards[0::2] - rewards[1::2])) * chosen_mask
    preference = (per_pair * chosen_mask).sum() / (pairs + 1e-8)
    loss = cfg.get("preference_loss_weight", 1.0) * preference
    if cfg.get("sft_loss_weight", 0.0) > 0:
        mask = token_mask * sample_mask[:, None]
        nll = -(lp * mask).sum(-1)
        if cfg.get("sft_average_log_probs"):
            nll = nll / mask.sum(-1).clamp(min=1)
        loss = loss + cfg["sft_loss_weight"] * (nll[0::2] * chosen_mask).sum() / (pairs + 1e-8)
    return loss


#: name: (NeMo RL's DPOLossFn options, posttrain's dpo options)
NEMO_CASES = {
    "defaults": ({"reference_policy_kl_penalty": 0.05}, {"beta": 0.05}),
    "average": ({"reference_policy_kl_penalty": 0.3, "preference_average_log_probs": True},
                {"beta": 0.3, "average_log_probs": True}),
    "sft_sum": ({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.2},
                {"beta": 0.1, "sft_weight": 0.2, "sft_reduction": "sum"}),
    "sft_mean": ({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.2, "sft_average_log_probs": True},
                 {"beta": 0.1, "sft_weight": 0.2}),
    "both_averaged": ({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.5, "sft_average_log_probs": True,
                       "preference_average_log_probs": True},
                      {"beta": 0.1, "sft_weight": 0.5, "average_log_probs": True}),
}


@pytest.mark.parametrize("pairs_per_part", [6, 3, 2])
@pytest.mark.parametrize("name", list(NEMO_CASES))
def test_dpo_matches_nemo_rl(name, pairs_per_part):
    theirs_cfg, ours = NEMO_CASES[name]
    for seed in range(3):
        lp, batch = pair_batch(seed)
        seqs, _ = counts(batch)
        got = ours_split(ours, lp, batch, pairs_per_part)
        rows = 2 * pairs_per_part
        want = sum(nemo_dpo(theirs_cfg, lp[i:i + rows], batch.slice(i, i + rows), seqs) for i in range(0, 2 * PAIRS, rows))
        (got_grad,) = torch.autograd.grad(got, lp)
        (want_grad,) = torch.autograd.grad(want, lp)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-7, atol=1e-12)
        assert got_grad[4:6].abs().sum() == 0  # the dropped pair


# ----------------------------------------------------------------------------- TRL


def trl_pair_loss(kind: str, beta: float, eps: float, chosen, rejected, chosen_tokens, rejected_tokens):
    """TRL's per-pair loss of ``kind`` from summed log-ratios (reverse-KL scores)."""
    delta = chosen - rejected
    if kind == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if kind == "hinge":
        return torch.relu(1 - beta * delta)
    if kind == "ipo":  # TRL divides each score by its completion's tokens
        return (chosen / chosen_tokens - rejected / rejected_tokens - 1 / (2 * beta)) ** 2
    if kind == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if kind == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * (chosen - rejected))
    if kind == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    raise AssertionError(kind)


def trl_dpo(kind: str, beta: float, eps: float, lp: torch.Tensor, batch: Batch, parts: int) -> torch.Tensor:
    """TRL's loss of one microbatch: rows stacked chosen-then-rejected, logprobs summed over
    each completion, the mean over its pairs, divided by the accumulation steps."""
    order = list(range(0, lp.shape[0], 2)) + list(range(1, lp.shape[0], 2))
    mask = batch["token_mask"][order]
    logps = (lp[order] * mask).sum(-1)
    ref = (batch["reference_logprobs"][order] * mask).sum(-1)
    ratios = logps - ref
    half = lp.shape[0] // 2
    tokens = mask.sum(-1).clamp(min=1)
    per_pair = trl_pair_loss(kind, beta, eps, ratios[:half], ratios[half:], tokens[:half], tokens[half:])
    return per_pair.mean() / parts


TRL_CASES = {
    "sigmoid": ({}, {}),
    "ipo": ({}, {"average_log_probs": True}),
    "hinge": ({}, {}),
    "robust": ({"eps": 0.2}, {"label_smoothing": 0.2}),
    "bco_pair": ({}, {}),
    "apo_zero": ({}, {}),
    "apo_down": ({}, {}),
    "sppo_hard": ({}, {}),
}


@pytest.mark.parametrize("pairs_per_part", [6, 3, 2])
@pytest.mark.parametrize("kind", list(TRL_CASES))
def test_dpo_loss_types_match_trl(kind, pairs_per_part):
    """TRL has no sample mask: every pair counts, in microbatches of equal size."""
    theirs, ours = TRL_CASES[kind]
    beta = 0.5
    for seed in range(3):
        lp, batch = pair_batch(seed, drop_pair=None)
        parts = PAIRS // pairs_per_part
        rows = 2 * pairs_per_part
        want = sum(trl_dpo(kind, beta, theirs.get("eps", 0.0), lp[i:i + rows], batch.slice(i, i + rows), parts)
                   for i in range(0, 2 * PAIRS, rows))
        got = ours_split({"beta": beta, "loss_type": kind, **ours}, lp, batch, pairs_per_part)
        (got_grad,) = torch.autograd.grad(got, lp)
        (want_grad,) = torch.autograd.grad(want, lp)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)
        assert got_grad.abs().sum() > 0


def test_label_smoothing_with_sigmoid_is_conservative_dpo_where_trl_ignores_it():
    """posttrain's sigmoid with label_smoothing eps is conservative DPO; TRL 1.16 ignores
    label_smoothing for sigmoid, so a TRL recipe setting it trains plain DPO: here the two
    differ, and eps 0 is TRL's."""
    lp, batch = pair_batch(1, drop_pair=None)
    plain = trl_dpo("sigmoid", 0.5, 0.3, lp, batch, 1)
    smoothed = ours_split({"beta": 0.5, "label_smoothing": 0.3}, lp, batch, PAIRS)
    assert not torch.isclose(smoothed, plain, rtol=1e-3)
    torch.testing.assert_close(ours_split({"beta": 0.5}, lp, batch, PAIRS), plain, rtol=1e-12, atol=0)
