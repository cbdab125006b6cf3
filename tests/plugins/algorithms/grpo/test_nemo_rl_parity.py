"""GRPO's loss and advantages against NeMo RL's semantics, in float64.

The references below are written from NeMo RL's ``ClippedPGLossFn``, its GRPO advantage
estimator (``calculate_baseline_and_std_per_prompt`` and the std normalisation), its
Reinforce++ and raw-reward estimators, its GAE with the KL in the token rewards and its DAPO
reward shaping, with NeMo RL's option names, vectorised the way NeMo RL computes (including
the 1e-8 it adds to every mean's denominator, hence the relative tolerances of 1e-7). NeMo RL
is not installed here; its logprobs are shifted one position against posttrain's, so the
references take tensors already aligned (position t holds log p(x_t | x_<t)) and zeros on
padding, where posttrain's batch holds -inf.

Each case runs on random batches with padding and a dropped sample, split into 1, 2 and 3
microbatches that share the global counts; loss values and gradients must match.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.batch import Batch
from posttrain_grpo.advantages import compute_advantages, consecutive_group_ids
from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.loss import ClippedPGLoss
from posttrain_grpo.rewards import overlong_penalty
from tests.plugins.algorithms.grpo.test_loss import BRANCH_SEED, global_counts, make_case, with_nonfinite_generation

F64 = torch.float64
EPS = 1e-8  # NeMo RL's masked_mean adds it to every denominator


# ----------------------------------------------------------------------------- NeMo RL's loss, from its formulas


def masked_mean(values, mask, dim=None, normalizer=None):
    count = mask.sum(dim=dim) if normalizer is None else normalizer
    return (values * mask).sum(dim=dim) / (count + EPS)


def nemo_kl(cfg: dict, curr, reference, weights):
    """Per-token KL of ``reference_policy_kl_type`` with NeMo RL's clamps: the weight is
    detached where the input clamp changes log(ref/curr); the output clamp acts on weight * k."""
    logr = reference - curr
    if cfg.get("kl_input_clamp_value", 20.0) is not None:
        bound = cfg.get("kl_input_clamp_value", 20.0)
        clamped = logr.clamp(-bound, bound)
        weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    kind = cfg.get("reference_policy_kl_type", "k3")
    k = -logr if kind == "k1" else logr.square() / 2 if kind == "k2" else torch.exp(logr) - 1 - logr
    kl = weights * k
    if cfg.get("kl_output_clamp_value", 10.0) is not None:
        bound = cfg.get("kl_output_clamp_value", 10.0)
        kl = kl.clamp(-bound, bound)
    return kl


def nemo_clipped_pg(cfg: dict, curr, data: dict, global_seqs, global_toks):
    """NeMo RL's ClippedPGLossFn value on one microbatch (``cfg`` in its option names)."""
    token_mask, sample_mask = data["token_mask"], data["sample_mask"]
    mask = token_mask * sample_mask[:, None]
    advantages = data["advantages"][:, None].expand_as(curr)
    gen = data["generation_logprobs"]
    prev = curr.detach() if cfg.get("force_on_policy_ratio") else data["prev_logprobs"]
    token_level = cfg.get("token_level_loss", True)

    def reduce(x):
        if token_level:
            return masked_mean(x, mask, normalizer=global_toks)
        return masked_mean(masked_mean(x, token_mask, dim=-1), sample_mask, normalizer=global_seqs)

    kl = torch.zeros((), dtype=F64)
    beta = cfg.get("reference_policy_kl_penalty", 0.0)
    if beta:
        if cfg.get("use_on_policy_kl_approximation"):
            weights = torch.exp(curr - gen)
        else:
            weights = torch.exp(curr - curr.detach())
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        kl = reduce(beta * nemo_kl(cfg, curr, data["reference_policy_logprobs"], weights))

    low, high = 1 - cfg.get("ratio_clip_min", 0.2), 1 + cfg.get("ratio_clip_max", 0.2)
    if cfg.get("force_on_policy_ratio"):
        ratios = torch.exp(curr - curr.detach())
        clamped = ratios
    elif cfg.get("disable_ppo_ratio"):
        ratios = clamped = curr
    else:
        log_ratios = curr - prev
        if cfg.get("sequence_level_importance_ratios"):
            log_ratios = masked_mean(log_ratios, token_mask, dim=-1)[:, None].expand_as(curr)
        ratios = torch.exp(log_ratios)
        clamped = ratios.clamp(low, high)
    if cfg.get("use_cispo"):
        clip_loss = -advantages * clamped.detach() * curr
    else:
        clip_loss = torch.maximum(-advantages * ratios, -advantages * clamped)
    if cfg.get("ratio_clip_c") is not None:
        clip_loss = torch.where(advantages < 0, torch.minimum(clip_loss, -advantages * cfg["ratio_clip_c"]), clip_loss)

    if cfg.get("sequence_level_importance_ratios"):
        weights = torch.exp(((prev - gen) * mask).sum(dim=-1)).detach()
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)[:, None]
    else:
        weights = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    kind = cfg.get("truncated_importance_sampling_type")
    top, bottom = cfg.get("truncated_importance_sampling_ratio"), cfg.get("truncated_importance_sampling_ratio_min")
    if kind == "tis":
        weights = weights.clamp(bottom if bottom is not None else 0.0, top)
    elif kind == "icepop":
        weights = torch.where((weights >= bottom) & (weights <= top), weights, 0.0)
    elif kind == "seq-mask-tis":
        log_is = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geo = torch.exp(masked_mean(log_is, token_mask, dim=-1)).detach()
        weights = weights * ((geo >= bottom) & (geo <= top)).to(F64)[:, None]
    if not cfg.get("use_importance_sampling_correction"):
        weights = torch.ones_like(curr)
    return reduce(weights * clip_loss) + kl


# ----------------------------------------------------------------------------- the cases

#: name: (NeMo RL's ClippedPGLossFn options, posttrain's grpo.loss options)
CASES = {
    "ppo": ({}, {}),
    "asymmetric_dual_clip": (
        {"ratio_clip_min": 0.1, "ratio_clip_max": 0.28, "ratio_clip_c": 1.5},
        {"ratio_clip_low": 0.1, "ratio_clip_high": 0.28, "dual_clip_c": 1.5},
    ),
    "sequence_level": ({"token_level_loss": False}, {"token_level_loss": False}),
    "reinforce": ({"disable_ppo_ratio": True}, {"disable_ppo_ratio": True}),
    "cispo": ({"use_cispo": True, "ratio_clip_min": 0.1, "ratio_clip_max": 0.15},
              {"policy_loss": "cispo", "ratio_clip_low": 0.1, "ratio_clip_high": 0.15}),
    "kl_k1": ({"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1"},
              {"kl_penalty": 0.1, "kl_estimator": "k1"}),
    "kl_k2_sequence": ({"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k2", "token_level_loss": False},
                       {"kl_penalty": 0.1, "kl_estimator": "k2", "token_level_loss": False}),
    "kl_k3_clamps_bind": (
        {"reference_policy_kl_penalty": 0.2, "kl_input_clamp_value": 0.3, "kl_output_clamp_value": 0.03},
        {"kl_penalty": 0.2, "kl_input_clamp": 0.3, "kl_output_clamp": 0.03},
    ),
    "on_policy_kl_approximation": (
        {"reference_policy_kl_penalty": 0.2, "use_on_policy_kl_approximation": True},
        {"kl_penalty": 0.2, "kl_importance_weight": "generation"},
    ),
    "on_policy_kl_approximation_clamps_bind": (
        {"reference_policy_kl_penalty": 0.2, "use_on_policy_kl_approximation": True, "kl_input_clamp_value": 0.4,
         "kl_output_clamp_value": 0.02},
        {"kl_penalty": 0.2, "kl_importance_weight": "generation", "kl_input_clamp": 0.4, "kl_output_clamp": 0.02},
    ),
    "tis": ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
             "truncated_importance_sampling_ratio": 1.2},
            {"importance_sampling_correction": "tis", "is_max": 1.2, "nonfinite_generation_logprobs": "drop_token"}),
    "icepop": ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 1.25, "truncated_importance_sampling_ratio_min": 0.8},
               {"importance_sampling_correction": "icepop", "is_min": 0.8, "is_max": 1.25,
                "nonfinite_generation_logprobs": "drop_token"}),
    "seq_mask_tis": ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
                      "truncated_importance_sampling_ratio": 1.07, "truncated_importance_sampling_ratio_min": 0.93},
                     {"importance_sampling_correction": "seq_mask_tis", "is_min": 0.93, "is_max": 1.07,
                      "nonfinite_generation_logprobs": "drop_token"}),
    "gspo": (
        {"sequence_level_importance_ratios": True, "token_level_loss": False, "use_importance_sampling_correction": True,
         "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.5,
         "ratio_clip_min": 0.01, "ratio_clip_max": 0.02},
        {"sequence_level_ratio": True, "token_level_loss": False, "sequence_is_weight": "product",
         "importance_sampling_correction": "tis", "is_max": 1.5, "ratio_clip_low": 0.01, "ratio_clip_high": 0.02},
    ),
    "everything": (
        {"ratio_clip_min": 0.15, "ratio_clip_max": 0.3, "ratio_clip_c": 2.0, "reference_policy_kl_penalty": 0.05,
         "use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
         "truncated_importance_sampling_ratio": 1.3, "truncated_importance_sampling_ratio_min": 0.7},
        {"ratio_clip_low": 0.15, "ratio_clip_high": 0.3, "dual_clip_c": 2.0, "kl_penalty": 0.05,
         "importance_sampling_correction": "icepop", "is_min": 0.7, "is_max": 1.3,
         "nonfinite_generation_logprobs": "drop_token"},
    ),
}


def nemo_inputs(batch: Batch) -> dict:
    """NeMo RL's data dict for the batch: the same values, zeros on padding."""
    valid = batch["token_mask"] > 0
    out = {name: batch[name] for name in ("token_mask", "sample_mask", "advantages")}
    for ours, theirs in (("prev_logprobs", "prev_logprobs"), ("generation_logprobs", "generation_logprobs"),
                         ("reference_logprobs", "reference_policy_logprobs")):
        out[theirs] = torch.where(valid, batch[ours], 0.0)
    return out


def split_losses(loss_of, lp: torch.Tensor, batch: Batch, parts: int) -> torch.Tensor:
    """The sum of ``loss_of(lp_part, batch_part)`` over ``parts`` equal microbatches."""
    size = lp.shape[0] // parts
    return sum(loss_of(lp[i * size:(i + 1) * size], batch.slice(i * size, (i + 1) * size)) for i in range(parts))


def assert_parity(nemo_cfg: dict, ours: dict, batch: Batch, lp: torch.Tensor, *, on_policy: bool = False) -> None:
    seqs, toks = global_counts(batch)
    loss_fn = ClippedPGLoss(ClippedPGConfig(**ours))
    ours_batch = Batch(**{k: batch[k] for k in batch.keys() if not (on_policy and k == "prev_logprobs")})
    for parts in (1, 2, 3):
        got = split_losses(lambda x, b: loss_fn(x, b, seqs, toks)[0], lp, ours_batch, parts)
        want = split_losses(lambda x, b: nemo_clipped_pg(nemo_cfg, torch.where(b["token_mask"] > 0, x, 0.0),
                                                         nemo_inputs(b), seqs, toks), lp, batch, parts)
        (got_grad,) = torch.autograd.grad(got, lp)
        (want_grad,) = torch.autograd.grad(want, lp)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-7, atol=1e-12)
        assert got_grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_pg_matches_nemo_rl(name):
    nemo_cfg, ours = CASES[name]
    lp, batch = make_case(seed=BRANCH_SEED)
    assert_parity(nemo_cfg, ours, batch, lp)


@pytest.mark.parametrize("name", ["ppo", "kl_k3_clamps_bind", "cispo"])
def test_force_on_policy_ratio_is_a_batch_without_prev_logprobs(name):
    nemo_cfg, ours = CASES[name]
    lp, batch = make_case(seed=BRANCH_SEED)
    assert_parity({**nemo_cfg, "force_on_policy_ratio": True}, ours, batch, lp, on_policy=True)


@pytest.mark.parametrize("name", ["tis", "icepop", "seq_mask_tis", "gspo"])
def test_nonfinite_generation_logprobs_match_nemo_rl(name):
    """NeMo RL zeroes the weight of a token whose engine logprob is not finite (our
    drop_token), and counts it as 0 in seq-mask-tis's geometric mean; GSPO's product weight
    of such a sequence is not finite, which NeMo RL zeroes (our drop_sequence)."""
    nemo_cfg, ours = CASES[name]
    if name == "gspo":
        ours = {**ours, "nonfinite_generation_logprobs": "drop_sequence"}
    lp, batch = make_case(seed=BRANCH_SEED)
    assert_parity(nemo_cfg, ours, with_nonfinite_generation(batch), lp)


def test_the_kl_gradient_where_a_clamp_binds_is_nemo_rls():
    """An example: k3 at logp -4, reference 0: the output clamp binds (e^4 - 5 > 10).
    NeMo RL gives no gradient; the code before the fix gave +10, the opposite sign to the
    unclamped -4."""
    lp = torch.tensor([[-4.0]], dtype=F64, requires_grad=True)
    data = dict(token_mask=torch.ones(1, 1, dtype=F64), sample_mask=torch.ones(1, dtype=F64),
                advantages=torch.zeros(1, dtype=F64), prev_logprobs=torch.tensor([[-4.0]], dtype=F64),
                generation_logprobs=torch.tensor([[-4.0]], dtype=F64), reference_logprobs=torch.zeros(1, 1, dtype=F64))
    ours, _ = ClippedPGLoss(ClippedPGConfig(kl_penalty=1.0))(lp, Batch(**data), torch.tensor(1.0), torch.tensor(1.0))
    nemo_data = {**data, "reference_policy_logprobs": data["reference_logprobs"]}
    theirs = nemo_clipped_pg({"reference_policy_kl_penalty": 1.0}, lp, nemo_data, torch.tensor(1.0), torch.tensor(1.0))
    (got,) = torch.autograd.grad(ours, lp)
    (want,) = torch.autograd.grad(theirs, lp)
    assert float(got) == float(want) == 0.0


# ----------------------------------------------------------------------------- advantages


def nemo_baseline_and_std(prompts, rewards, valid, leave_one_out: bool):
    """NeMo RL's per-prompt baseline and std: sums over each prompt's valid samples with the
    sample itself left out (leave-one-out), and the std from the mean of squares."""
    baseline, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for prompt in torch.unique(prompts):
        idx = (prompts == prompt).nonzero().squeeze(1)
        n = len(idx)
        weights = 1 - torch.eye(n, dtype=F64) if leave_one_out else torch.ones(n, n, dtype=F64)
        if valid[idx].sum() <= 1:
            baseline[idx] = rewards[idx]
            continue
        count = valid[idx].sum() - int(leave_one_out)
        mean = weights @ (rewards[idx] * valid[idx]) / count
        square = weights @ (rewards[idx] ** 2 * valid[idx]) / count
        baseline[idx] = mean
        std[idx] = ((square - mean ** 2) * (count / (count - 1))).sqrt().nan_to_num(0.0)
    return baseline, std


def nemo_grpo_advantages(prompts, rewards, valid, leave_one_out: bool, normalize: bool):
    baseline, std = nemo_baseline_and_std(prompts, rewards, valid, leave_one_out)
    adv = rewards - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + 1e-6), adv)
    return adv


def reward_batch(seed: int, groups: int = 6, size: int = 5):
    """Rewards in {0, 0.5, 1} and a few continuous values, one group all equal."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (groups * size,), generator=g).to(F64) / 2
    rewards[size:2 * size] = 0.7  # a group without signal
    rewards[-size:] = torch.rand(size, generator=g, dtype=F64)
    return rewards, consecutive_group_ids(groups * size, size)


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_valid_mask", [False, True])
def test_grpo_advantages_match_nemo_rl(leave_one_out, normalize, with_valid_mask):
    """The GRPO estimator (use_leave_one_out_baseline, normalize_rewards); NeMo RL's valid mask
    is our grpo.baseline_valid_only. Samples outside the mask do not train; NeMo RL leaves
    them an arbitrary value, posttrain 0, so only the valid ones are compared."""
    for seed in range(4):
        rewards, groups = reward_batch(seed)
        valid = torch.ones_like(rewards)
        if with_valid_mask:
            valid[torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed))[:7]] = 0.0
        ours = compute_advantages(rewards, groups, leave_one_out=leave_one_out, normalize=normalize,
                                  valid=valid > 0 if with_valid_mask else None)
        theirs = nemo_grpo_advantages(groups, rewards, valid, leave_one_out, normalize)
        keep = valid > 0
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-9, atol=1e-9)
        if with_valid_mask:
            assert (ours[~keep] == 0).all()


def test_reinforce_plus_plus_and_raw_reward_advantages_match_nemo_rl():
    """Reinforce++ (minus_baseline: the group mean; then whitened over the valid tokens) is
    baseline mean + whiten_advantages tokens; the raw-reward estimator with
    normalize_advantages is baseline none + whiten_advantages tokens."""
    rewards, groups = reward_batch(7)
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 9, rewards.shape, generator=g)
    sample_mask = torch.ones_like(rewards)
    sample_mask[3] = 0.0
    mask = (torch.arange(9)[None, :] < lengths[:, None]).to(F64) * sample_mask[:, None]

    def whiten(adv):  # NeMo RL: token-weighted mean and variance over the mask, rsqrt(max(var, 1e-8))
        per_token = adv[:, None].expand_as(mask)
        mean = (per_token * mask).sum() / mask.sum()
        var = ((per_token - mean) ** 2 * mask).sum() / mask.sum()
        return (adv - mean) * var.clamp(min=1e-8).rsqrt()

    baseline, _ = nemo_baseline_and_std(groups, rewards, torch.ones_like(rewards), leave_one_out=False)
    for subtract, theirs in ((True, whiten(rewards - baseline)), (False, whiten(rewards))):
        ours = compute_advantages(rewards, groups, leave_one_out=False, normalize=False, subtract_baseline=subtract,
                                  whiten="tokens", trained=sample_mask > 0, token_counts=lengths)
        keep = sample_mask > 0
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=1e-9, atol=1e-12)


def test_kl_in_reward_return_to_go_is_nemo_rls_gae_with_unit_discounts():
    """NeMo RL's GAE puts -kl_coef * KL(prev || ref) on every response token and the reward on
    the last; with gamma = lambda = 1 and zero values its advantage is the return to go,
    R - beta * sum_{s >= t} k_s: REINFORCE's gradient per token is -A_t / tokens."""
    lp, batch = make_case(seed=4, drop_last=False)
    beta = 0.3
    mask = batch["token_mask"]
    valid = mask > 0
    prev = torch.where(valid, batch["prev_logprobs"], 0.0)
    ref = torch.where(valid, batch["reference_logprobs"], 0.0)
    kl = nemo_kl({}, prev, ref, torch.ones_like(prev))
    token_rewards = -beta * kl * mask
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
    token_rewards[torch.arange(len(last)), last] += batch["advantages"]
    gae = torch.zeros_like(token_rewards)
    running = torch.zeros(mask.shape[0], dtype=F64)
    for t in reversed(range(mask.shape[1])):  # delta_t = r_t (zero values), carried over masked positions
        running = torch.where(valid[:, t], token_rewards[:, t] + running, running)
        gae[:, t] = running
    cfg = ClippedPGConfig(disable_ppo_ratio=True, kl_penalty=beta, kl_in_reward="return_to_go")
    seqs, toks = global_counts(batch)
    loss, _ = ClippedPGLoss(cfg)(lp, batch, seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.where(valid, -gae / toks, 0.0), rtol=1e-12, atol=1e-14)


def test_dapo_linear_overlong_penalty_matches_nemo_rl():
    """NeMo RL's DAPO shaping: min(-(length - (L - C)) / C * penalty, 0), without a floor."""
    lengths = torch.arange(0, 33)
    L, C, penalty = 24, 8, 0.7
    theirs = [min(-(n - (L - C)) / C * penalty, 0.0) for n in lengths.tolist()]
    ours = overlong_penalty(lengths, max_response_length=L, buffer_length=C, penalty=penalty, beyond_max="linear")
    assert ours.tolist() == pytest.approx(theirs, abs=1e-6)
    assert min(theirs) == pytest.approx(-2 * penalty)  # L + C = 32 tokens: twice the penalty


def test_gspo_weights_differ_between_the_geometric_mean_and_the_product():
    """Why the option exists: the same batch under GSPO with TIS at 1.5 gives different
    losses with posttrain's default geometric mean and NeMo RL's product."""
    lp, batch = make_case(seed=BRANCH_SEED, seq_len=16)
    seqs, toks = global_counts(batch)
    nemo_cfg, ours = CASES["gspo"]
    product, _ = ClippedPGLoss(ClippedPGConfig(**ours))(lp, batch, seqs, toks)
    geometric, _ = ClippedPGLoss(ClippedPGConfig(**{**ours, "sequence_is_weight": "geometric_mean"}))(lp, batch, seqs,
                                                                                                       toks)
    theirs = nemo_clipped_pg(nemo_cfg, torch.where(batch["token_mask"] > 0, lp, 0.0), nemo_inputs(batch), seqs, toks)
    torch.testing.assert_close(product, theirs, rtol=1e-7, atol=0)
    assert not math.isclose(float(product), float(geometric), rel_tol=1e-3)


def nemo_gdpo(prompts, parts: torch.Tensor, weights, leave_one_out: bool = True):
    """NeMo RL's GDPO estimator: each part's GRPO advantage, their weighted sum, then shifted
    to mean 0 and divided by its (unbiased) std where that is > 0."""
    valid = torch.ones(parts.shape[0], dtype=F64)
    total = sum(w * nemo_grpo_advantages(prompts, parts[:, k], valid, leave_one_out, normalize=True)
                for k, w in enumerate(weights))
    std = total.std()
    return (total - total.mean()) / std if std > 0 else total - total.mean()


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("weights", [None, (1.0, 0.5, 2.0)])
def test_gdpo_advantages_match_nemo_rl(leave_one_out, weights):
    from posttrain_grpo.advantages import normalize_then_sum

    g = torch.Generator().manual_seed(3)
    parts = torch.stack([torch.randint(0, 2, (24,), generator=g).to(F64),  # correct
                         torch.randint(0, 3, (24,), generator=g).to(F64) / 2,  # format
                         torch.rand(24, generator=g, dtype=F64)], dim=1)  # a continuous score
    parts[:6, 0] = 1.0  # a group whose correctness does not vary
    groups = consecutive_group_ids(24, 6)
    ours = normalize_then_sum(parts, groups, weights, leave_one_out=leave_one_out, normalize=True)
    theirs = nemo_gdpo(groups, parts, weights or (1.0, 1.0, 1.0), leave_one_out)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
