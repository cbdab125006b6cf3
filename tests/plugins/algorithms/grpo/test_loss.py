"""ClippedPGLoss against a float64 reference written token by token from the formulas."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from posttrain.batch import Batch
from posttrain.errors import ConfigError
from posttrain.interfaces import LossType, combine_metrics
from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.loss import ClippedPGLoss

F64 = torch.float64


# ----------------------------------------------------------------------------- data


def make_case(
    seed: int, *, batch_size: int = 6, seq_len: int = 12, token_advantages: bool = False, drop_last: bool = True
):
    """Logprobs (leaf, float64) and a batch with prompts, responses of varied length and
    padding. Padding positions of prev/generation/reference logprobs hold -inf, which must
    never reach the loss."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(batch_size, seq_len, dtype=F64)
    for i in range(batch_size):
        prompt = 1 + i % 3
        length = int(torch.randint(2, seq_len - prompt + 1, (1,), generator=g))
        token_mask[i, prompt : prompt + length] = 1.0
    valid = token_mask > 0

    def noise(scale):
        return scale * torch.randn(batch_size, seq_len, generator=g, dtype=F64)

    lp = torch.where(valid, -(torch.rand(batch_size, seq_len, generator=g, dtype=F64) * 2 + 0.05), 0.0)
    prev = torch.where(valid, lp + noise(0.4), -math.inf)
    gen = torch.where(valid, prev + noise(0.3), -math.inf)
    ref = torch.where(valid, lp + noise(0.5), -math.inf)
    if token_advantages:
        advantages = torch.randn(batch_size, seq_len, generator=g, dtype=F64)
    else:  # alternating signs, so both clip sides are reached
        advantages = torch.rand(batch_size, generator=g, dtype=F64) + 0.1
        advantages[1::2] *= -1
    sample_mask = torch.ones(batch_size, dtype=F64)
    if drop_last:
        sample_mask[-1] = 0.0
    batch = Batch(
        token_mask=token_mask,
        sample_mask=sample_mask,
        advantages=advantages,
        prev_logprobs=prev,
        generation_logprobs=gen,
        reference_logprobs=ref,
    )
    return lp.requires_grad_(), batch


def global_counts(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid sequences, valid tokens) as a policy counts them over the global batch."""
    seqs = batch["sample_mask"].sum()
    toks = (batch["token_mask"] * batch["sample_mask"][:, None]).sum()
    return seqs, toks


# ----------------------------------------------------------------------------- reference


def reference_loss(cfg: ClippedPGConfig, lp: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The loss from the formulas, one token at a time, in float64.

    The KL's score-function term is written as the surrogate ``k * (logp - sg(logp))``
    (value 0, gradient ``k * dlogp``), not as the implementation's ``k * exp(logp - sg)``.
    """
    n_seqs, n_toks = global_counts(batch)
    total = lp.new_zeros(())
    for i in range(lp.shape[0]):
        tokens = [t for t in range(lp.shape[1]) if batch["token_mask"][i, t] > 0]
        if batch["sample_mask"][i] == 0 or not tokens:
            continue
        prev = [float(batch["prev_logprobs"][i, t]) for t in tokens]
        gen = [float(batch["generation_logprobs"][i, t]) for t in tokens]
        # the engine's log-ratios; a non-finite one counts as 0 in every aggregate
        bad = [not math.isfinite(p - q) for p, q in zip(prev, gen, strict=True)]
        d = [0.0 if b else p - q for p, q, b in zip(prev, gen, bad, strict=True)]
        if cfg.nonfinite_generation_logprobs == "drop_sequence":
            keep = [not any(bad)] * len(tokens)
        else:
            keep = [cfg.nonfinite_generation_logprobs == "neutral_token" or not b for b in bad]
        anchor = prev
        if cfg.rollout_correction == "bypass":
            anchor = [float(lp[i, t]) if b else q for t, q, b in zip(tokens, gen, bad, strict=True)]
        seq_log_ratio = sum(lp[i, t] - a for t, a in zip(tokens, anchor, strict=True)) / len(tokens)
        shift = reference_kl_shift(cfg, [float(batch["reference_logprobs"][i, t]) for t in tokens], prev)
        terms = []
        for k, t in enumerate(tokens):
            adv = float(batch["advantages"][i, t] if batch["advantages"].dim() == 2 else batch["advantages"][i])
            adv -= shift[k]
            ratio = torch.exp(seq_log_ratio if cfg.sequence_level_ratio else lp[i, t] - anchor[k])
            term = reference_objective(cfg, lp[i, t], ratio, adv)
            if cfg.importance_sampling_correction is not None:
                term = term * reference_is_weight(cfg, d, k) * keep[k]
            elif cfg.rollout_correction == "bypass" and not keep[k]:
                term = term * 0.0
            if cfg.kl_penalty > 0 and cfg.kl_in_reward is None:
                term = term + cfg.kl_penalty * reference_kl(cfg, float(batch["reference_logprobs"][i, t]), lp[i, t],
                                                            ratio, gen[k])
            terms.append(term)
        total = total + (sum(terms) if cfg.token_level_loss else sum(terms) / len(terms))
    if not cfg.token_level_loss:
        return total / n_seqs
    if cfg.token_normalizer == "constant":
        return total / (n_seqs * cfg.constant_normalizer)
    return total / n_toks  # global; microbatch too, for a batch that is one microbatch


def reference_objective(cfg: ClippedPGConfig, lp: torch.Tensor, ratio: torch.Tensor, adv: float) -> torch.Tensor:
    if cfg.disable_ppo_ratio:
        return -adv * lp
    low, high = 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high
    if cfg.policy_loss == "cispo":
        return -adv * float(torch.clamp(ratio, low, high)) * lp
    if cfg.policy_loss == "sapo":
        tau = cfg.sapo_temperature_pos if adv > 0 else cfg.sapo_temperature_neg
        return -adv * torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    unclipped_loss, clipped_loss = -adv * ratio, -adv * torch.clamp(ratio, low, high)
    term = unclipped_loss if unclipped_loss >= clipped_loss else clipped_loss
    if cfg.dual_clip_c is not None and adv < 0 and term > -cfg.dual_clip_c * adv:
        term = torch.tensor(-cfg.dual_clip_c * adv, dtype=F64)
    return term


def reference_is_weight(cfg: ClippedPGConfig, d: list[float], k: int) -> float:
    """The weight of token k of a sequence whose engine log-ratios are ``d``."""
    mean, total = sum(d) / len(d), sum(d)
    kind = cfg.importance_sampling_correction
    low = cfg.is_min if cfg.is_min is not None else 0.0
    if kind in ("sequence_truncate", "sequence_mask"):
        log_w = total
    elif cfg.sequence_level_ratio:
        log_w = total if cfg.sequence_is_weight == "product" else mean
    else:
        log_w = d[k]
    w = math.exp(log_w)
    if kind in ("tis", "sequence_truncate"):
        return min(max(w, low), cfg.is_max)
    if kind in ("icepop", "sequence_mask"):
        return w if low <= w <= cfg.is_max else 0.0
    return w if low <= math.exp(mean) <= cfg.is_max else 0.0  # seq_mask_tis


def reference_kl_value(cfg: ClippedPGConfig, ref: float, lp):
    """The estimate at ``lp`` (a float, or a tensor with gradient) and whether the input clamp bound."""
    x = ref - lp  # log(pi_ref / pi)
    bound = cfg.kl_input_clamp is not None and abs(float(x)) > cfg.kl_input_clamp
    if bound:
        x = math.copysign(cfg.kl_input_clamp, float(x))
    if cfg.kl_estimator == "k1":
        return -x, bound
    if cfg.kl_estimator == "k2":
        return 0.5 * x * x, bound
    return (math.exp(x) if isinstance(x, float) else torch.exp(x)) - 1 - x, bound


def reference_kl(cfg: ClippedPGConfig, ref: float, lp: torch.Tensor, ratio: torch.Tensor, gen: float) -> torch.Tensor:
    """The weighted estimate; a token where a clamp binds is a constant (value only, no
    gradient of any kind)."""
    k, bound = reference_kl_value(cfg, ref, lp)
    k = torch.as_tensor(k, dtype=F64)
    form = cfg.kl_importance_weight
    if form == "on_policy":
        term = k + k.detach() * (lp - lp.detach())
    elif form == "none":
        term = k
    elif form == "prev":
        term = ratio * k
    else:  # generation
        term = torch.exp(lp - gen) * k if math.isfinite(gen) else k * 0.0
    if cfg.kl_output_clamp is not None and abs(float(term)) > cfg.kl_output_clamp:
        return torch.tensor(math.copysign(cfg.kl_output_clamp, float(term)), dtype=F64)
    return term.detach() if bound else term


def reference_kl_shift(cfg: ClippedPGConfig, ref: list[float], prev: list[float]) -> list[float]:
    """What kl_in_reward takes off each token's advantage."""
    if cfg.kl_in_reward is None:
        return [0.0] * len(ref)
    k = [reference_kl_value(cfg, r, p)[0] for r, p in zip(ref, prev, strict=True)]
    if cfg.kl_in_reward == "return_to_go":
        k = [sum(k[j:]) for j in range(len(k))]
    return [cfg.kl_penalty * v for v in k]


# ----------------------------------------------------------------------------- every option

SEQ = {"token_level_loss": False}
CASES = {
    "ppo_token_level": {},
    "asymmetric_clip": {"ratio_clip_low": 0.1, "ratio_clip_high": 0.28},
    "dual_clip": {"dual_clip_c": 1.5},
    "sequence_level": SEQ,
    "gspo": {**SEQ, "sequence_level_ratio": True, "ratio_clip_low": 0.01, "ratio_clip_high": 0.02},
    "reinforce_token": {"disable_ppo_ratio": True},
    "reinforce_sequence": {**SEQ, "disable_ppo_ratio": True},
    "kl_k1": {"kl_penalty": 0.1, "kl_estimator": "k1"},
    "kl_k2": {"kl_penalty": 0.1, "kl_estimator": "k2"},
    "kl_k3": {"kl_penalty": 0.1, "kl_estimator": "k3"},
    "kl_k3_sequence": {**SEQ, "kl_penalty": 0.1},
    "kl_clamps_bind": {"kl_penalty": 0.2, "kl_estimator": "k3", "kl_input_clamp": 0.3, "kl_output_clamp": 0.03},
    "tis": {"importance_sampling_correction": "tis", "is_max": 1.2},
    "tis_two_sided": {"importance_sampling_correction": "tis", "is_min": 0.8, "is_max": 1.2},
    "icepop": {"importance_sampling_correction": "icepop", "is_min": 0.8, "is_max": 1.25},
    "seq_mask_tis": {"importance_sampling_correction": "seq_mask_tis", "is_min": 0.93, "is_max": 1.07},
    "gspo_tis": {**SEQ, "sequence_level_ratio": True, "importance_sampling_correction": "tis", "is_max": 1.05},
    "gspo_icepop": {
        **SEQ,
        "sequence_level_ratio": True,
        "importance_sampling_correction": "icepop",
        "is_min": 0.95,
        "is_max": 1.05,
    },
    "reinforce_tis": {"disable_ppo_ratio": True, "importance_sampling_correction": "tis", "is_max": 1.1},
    "cispo": {"policy_loss": "cispo", "ratio_clip_low": 0.1, "ratio_clip_high": 0.15},
    "cispo_sequence": {**SEQ, "policy_loss": "cispo", "ratio_clip_high": 0.1},
    "sapo": {**SEQ, "policy_loss": "sapo"},
    "sapo_token_temperatures": {"policy_loss": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
    "dr_grpo": {"token_normalizer": "constant", "constant_normalizer": 16},
    "kl_none": {"kl_penalty": 0.2, "kl_importance_weight": "none"},
    "kl_prev": {"kl_penalty": 0.2, "kl_importance_weight": "prev"},
    "kl_generation": {"kl_penalty": 0.2, "kl_importance_weight": "generation"},
    "kl_generation_clamps_bind": {"kl_penalty": 0.2, "kl_importance_weight": "generation", "kl_input_clamp": 0.4,
                                  "kl_output_clamp": 0.02},
    "kl_gspo_prev": {**SEQ, "sequence_level_ratio": True, "kl_penalty": 0.2, "kl_importance_weight": "prev"},
    "kl_in_reward_token": {"kl_penalty": 0.3, "kl_in_reward": "token"},
    "kl_in_reward_return_to_go": {"kl_penalty": 0.3, "kl_in_reward": "return_to_go", "kl_estimator": "k1"},
    "sequence_truncate": {"importance_sampling_correction": "sequence_truncate", "is_max": 1.3},
    "sequence_mask": {"importance_sampling_correction": "sequence_mask", "is_min": 0.5, "is_max": 1.5},
    "gspo_product_tis": {**SEQ, "sequence_level_ratio": True, "sequence_is_weight": "product",
                         "importance_sampling_correction": "tis", "is_max": 1.3},
    "gspo_product_icepop": {**SEQ, "sequence_level_ratio": True, "sequence_is_weight": "product",
                            "importance_sampling_correction": "icepop", "is_min": 0.5, "is_max": 1.5},
    "bypass": {"rollout_correction": "bypass"},
    "bypass_cispo": {"rollout_correction": "bypass", "policy_loss": "cispo"},
    "everything": {
        "ratio_clip_low": 0.15,
        "ratio_clip_high": 0.3,
        "dual_clip_c": 2.0,
        "kl_penalty": 0.05,
        "importance_sampling_correction": "icepop",
        "is_min": 0.7,
        "is_max": 1.3,
    },
}

#: Data whose ratios and weights reach every branch below (asserted in the test).
BRANCH_SEED = 18
#: Metrics that must be strictly between 0 and 1 in a case, so the case exercises its branch.
EXERCISED = {
    "ppo_token_level": ["clip_fraction_low", "clip_fraction_high"],
    "dual_clip": ["dual_clip_fraction"],
    "gspo": ["clip_fraction_low", "clip_fraction_high"],
    "tis": ["is_oob_fraction"],
    "tis_two_sided": ["is_oob_fraction"],
    "icepop": ["is_oob_fraction"],
    "seq_mask_tis": ["is_oob_fraction"],
    "gspo_tis": ["is_oob_fraction"],
    "gspo_icepop": ["is_oob_fraction"],
    "everything": ["clip_fraction_low", "clip_fraction_high", "dual_clip_fraction", "is_oob_fraction"],
    "cispo": ["clip_fraction_low", "clip_fraction_high"],
    "sequence_truncate": ["is_oob_fraction"],
    "sequence_mask": ["is_oob_fraction"],
    "gspo_product_tis": ["is_oob_fraction"],
    "gspo_product_icepop": ["is_oob_fraction"],
    "bypass": ["clip_fraction_low", "clip_fraction_high"],
}


@pytest.mark.parametrize("token_advantages", [False, True], ids=["seq_adv", "token_adv"])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_match_reference(name, token_advantages):
    cfg = ClippedPGConfig(**CASES[name])
    loss_fn = ClippedPGLoss(cfg)
    lp, batch = make_case(seed=BRANCH_SEED, token_advantages=token_advantages)
    seqs, toks = global_counts(batch)

    loss, metrics = loss_fn(lp, batch, seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = reference_loss(cfg, lp, batch)
    (expected_grad,) = torch.autograd.grad(expected, lp)

    assert loss.dtype == F64
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert grad.abs().sum() > 0
    assert metrics["loss"] == pytest.approx(float(expected.detach()))
    for metric in EXERCISED.get(name, []):
        assert 0 < metrics[metric] < 1, f"case {name} does not exercise {metric}: {metrics[metric]}"


@pytest.mark.parametrize(
    "name",
    ["ppo_token_level", "asymmetric_clip", "dual_clip", "gspo", "reinforce_sequence", "tis", "seq_mask_tis", "sapo",
     "sapo_token_temperatures", "dr_grpo", "sequence_mask", "bypass", "kl_none", "kl_in_reward_return_to_go"],
)
def test_gradcheck(name):
    """Finite differences agree with autograd (KL in the loss only with ``kl_importance_weight:
    none``: the other forms add a score-function term, invisible to finite differences by
    design; CISPO likewise, its clipped ratio being a detached weight)."""
    cfg = ClippedPGConfig(**CASES[name])
    loss_fn = ClippedPGLoss(cfg)
    lp, batch = make_case(seed=7, batch_size=3, seq_len=6)
    seqs, toks = global_counts(batch)
    assert torch.autograd.gradcheck(lambda x: loss_fn(x, batch, seqs, toks)[0], (lp,), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- KL gradient


def one_token_kl_gradient(logp: float, ref: float, prev: float | None = None, gen: float | None = None,
                          **options) -> float:
    """d loss / d logp of the KL term alone (beta 1, no advantage) for one sampled token."""
    lp = torch.tensor([[logp]], dtype=F64, requires_grad=True)
    batch = Batch(
        token_mask=torch.ones(1, 1, dtype=F64),
        sample_mask=torch.ones(1, dtype=F64),
        advantages=torch.zeros(1, dtype=F64),
        reference_logprobs=torch.tensor([[ref]], dtype=F64),
        **({"prev_logprobs": torch.tensor([[prev]], dtype=F64)} if prev is not None else {}),
        **({"generation_logprobs": torch.tensor([[gen]], dtype=F64)} if gen is not None else {}),
    )
    loss_fn = ClippedPGLoss(ClippedPGConfig(kl_penalty=1.0, kl_estimator="k3", **options))
    loss, _ = loss_fn(lp, batch, torch.tensor(1.0), torch.tensor(1.0))
    (grad,) = torch.autograd.grad(loss, lp)
    return float(grad)


@pytest.mark.parametrize(
    ("logp", "ref", "options", "expected"),
    [
        # unclamped: k3 plus its score-function term gives the reverse-KL gradient logp - ref
        (-1.5, 0.0, {}, -1.5),
        (-0.2, -2.0, {}, 1.8),
        (-4.0, 0.0, {"kl_output_clamp": None}, -4.0),
        # the output clamp binds (k3 = e^4 - 5 = 49.6 > 10): no gradient, never the clamp's +10
        (-4.0, 0.0, {}, 0.0),
        # the input clamp binds (|lr| = 4 > 3): no gradient
        (-4.0, 0.0, {"kl_input_clamp": 3.0, "kl_output_clamp": None}, 0.0),
        (0.0, -4.0, {"kl_input_clamp": 3.0}, 0.0),
    ],
    ids=["pull_up", "push_down", "no_output_clamp", "output_clamp_binds", "input_clamp_binds", "input_clamp_below"],
)
def test_kl_gradient_points_toward_the_reference_and_vanishes_where_a_clamp_binds(logp, ref, options, expected):
    """Gradient descent on the KL term moves a token's logprob toward the reference's; where a
    clamp binds the term has no gradient (NeMo RL's semantics), so it never pushes away."""
    assert one_token_kl_gradient(logp, ref, **options) == pytest.approx(expected, abs=1e-12)


E15 = math.exp(1.5)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # k3 = e^lr - 1 - lr at lr = ref - logp = 1.5; on policy the weight exp(logp - sg(logp))
        # adds k3 * dlogp: (e^1.5 - 2.5) + (1 - e^1.5) = -1.5, the reverse-KL gradient
        ({}, -1.5),
        # none: k3's own gradient 1 - e^lr (TRL without bias correction)
        ({"kl_importance_weight": "none"}, 1 - E15),
        # prev, on policy (no prev_logprobs): the ratio is exp(logp - sg(logp)): as on_policy
        ({"kl_importance_weight": "prev"}, -1.5),
        # prev off policy, logp - prev = 0.5: w = e^0.5, gradient w k3 + w (1 - e^lr)
        ({"kl_importance_weight": "prev", "prev": -2.0}, math.exp(0.5) * (E15 - 2.5 + 1 - E15)),
        # generation, logp - gen = -0.3 (NeMo RL's on-policy approximation)
        ({"kl_importance_weight": "generation", "gen": -1.2}, math.exp(-0.3) * (E15 - 2.5 + 1 - E15)),
        # an engine logprob of -inf gives weight 0, and no NaN
        ({"kl_importance_weight": "generation", "gen": -math.inf}, 0.0),
        # the output clamp binds on the weighted value: no gradient (w k3 = e^2 (e^1.5 - 2.5) > 10)
        ({"kl_importance_weight": "generation", "gen": -3.5}, 0.0),
    ],
    ids=["on_policy", "none", "prev_on_policy", "prev_off_policy", "generation", "generation_nonfinite",
         "generation_output_clamp"],
)
def test_kl_gradient_forms(options, expected):
    """Each ``kl_importance_weight`` gives its documented gradient for one token (logp -1.5,
    reference 0, k3)."""
    assert one_token_kl_gradient(-1.5, 0.0, **options) == pytest.approx(expected, abs=1e-12)


def test_kl_in_reward_shifts_the_advantages_by_hand():
    """Two tokens, k1 at the proximal policy: k = prev - ref = (0.5, 0.25), beta 0.4. token:
    A_t = 1 - 0.4 k_t = (0.8, 0.9); return_to_go: A_t = 1 - 0.4 sum_{s>=t} k_s = (0.7, 0.9).
    REINFORCE's loss is -mean_t A_t logp_t, and the KL adds nothing to the loss itself."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    batch = Batch(
        token_mask=torch.ones(1, 2, dtype=F64), sample_mask=torch.ones(1, dtype=F64), advantages=torch.ones(1, dtype=F64),
        prev_logprobs=torch.tensor([[-0.5, -0.75]], dtype=F64), reference_logprobs=torch.tensor([[-1.0, -1.0]], dtype=F64),
    )
    for form, advantages in (("token", (0.8, 0.9)), ("return_to_go", (0.7, 0.9))):
        cfg = ClippedPGConfig(disable_ppo_ratio=True, kl_penalty=0.4, kl_estimator="k1", kl_in_reward=form)
        loss, metrics = ClippedPGLoss(cfg)(lp, batch, torch.tensor(1.0), torch.tensor(2.0))
        (grad,) = torch.autograd.grad(loss, lp)
        assert float(loss) == pytest.approx(-(advantages[0] * -1.0 + advantages[1] * -2.0) / 2)
        torch.testing.assert_close(grad, -torch.tensor([advantages], dtype=F64) / 2)
        assert metrics["loss"] == metrics["pg_loss"]


# ----------------------------------------------------------------------------- non-finite engine logprobs

#: Corrections whose weights see the engine's logprobs, and bypass, which trains on them.
NONFINITE_CASES = {
    "tis": {"importance_sampling_correction": "tis", "is_max": 1.3},
    "icepop": {"importance_sampling_correction": "icepop", "is_min": 0.5, "is_max": 1.5},
    "seq_mask_tis": {"importance_sampling_correction": "seq_mask_tis", "is_min": 0.7, "is_max": 1.4},
    "sequence_mask": {"importance_sampling_correction": "sequence_mask", "is_min": 0.2, "is_max": 3.0},
    "gspo_product": {**SEQ, "sequence_level_ratio": True, "sequence_is_weight": "product",
                     "importance_sampling_correction": "tis", "is_max": 3.0},
    "bypass": {"rollout_correction": "bypass"},
}


def with_nonfinite_generation(batch: Batch) -> Batch:
    """The batch with the engine's logprob of two loss tokens of row 0 and one of row 2 not finite."""
    gen = batch["generation_logprobs"].clone()
    for row, column, value in ((0, 0, -math.inf), (0, -1, math.nan), (2, -1, math.inf)):
        gen[row, (batch["token_mask"][row] > 0).nonzero().squeeze(1)[column]] = value
    return Batch(**{**{k: batch[k] for k in batch.keys()}, "generation_logprobs": gen})


@pytest.mark.parametrize("handling", ["drop_sequence", "drop_token", "neutral_token"])
@pytest.mark.parametrize("name", list(NONFINITE_CASES))
def test_nonfinite_generation_logprobs(name, handling):
    """Loss and gradient are finite and follow the reference: drop_sequence weighs the
    sequences 0, drop_token the tokens, neutral_token counts the tokens as agreeing."""
    cfg = ClippedPGConfig(**NONFINITE_CASES[name], nonfinite_generation_logprobs=handling)
    lp, batch = make_case(seed=BRANCH_SEED)
    batch = with_nonfinite_generation(batch)
    seqs, toks = global_counts(batch)
    loss, _ = ClippedPGLoss(cfg)(lp, batch, seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = reference_loss(cfg, lp, batch)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    rows_with_gradient = (grad.abs().sum(dim=1) > 0).tolist()
    assert rows_with_gradient[0] == (handling != "drop_sequence") and rows_with_gradient[1]
    if handling == "drop_sequence":
        assert not rows_with_gradient[2]


def test_nonfinite_generation_logprob_by_hand():
    """One sequence of three tokens, on policy (r = 1), A = 1, TIS to [0, 10]: d = (0.2, inf, 0.1).
    drop_token: weights (e^0.2, 0, e^0.1); neutral_token: (e^0.2, 1, e^0.1); drop_sequence: 0."""
    lp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    batch = Batch(
        token_mask=torch.ones(1, 3, dtype=F64), sample_mask=torch.ones(1, dtype=F64), advantages=torch.ones(1, dtype=F64),
        generation_logprobs=torch.tensor([[-1.2, -math.inf, -1.1]], dtype=F64),
    )
    for handling, weights in (("drop_token", (math.exp(0.2), 0.0, math.exp(0.1))),
                              ("neutral_token", (math.exp(0.2), 1.0, math.exp(0.1))),
                              ("drop_sequence", (0.0, 0.0, 0.0))):
        cfg = ClippedPGConfig(importance_sampling_correction="tis", is_max=10.0, nonfinite_generation_logprobs=handling)
        loss, _ = ClippedPGLoss(cfg)(lp, batch, torch.tensor(1.0), torch.tensor(3.0))
        assert float(loss) == pytest.approx(-sum(weights) / 3, abs=1e-15), handling


# ----------------------------------------------------------------------------- metrics


def loop_reduce(cfg: ClippedPGConfig, batch: Batch, value) -> float:
    """Normalise ``value(i, t)`` over valid tokens like the loss, with plain loops."""
    n_seqs, n_toks = global_counts(batch)
    total = 0.0
    for i in range(batch["token_mask"].shape[0]):
        tokens = [t for t in range(batch["token_mask"].shape[1]) if batch["token_mask"][i, t] > 0]
        if batch["sample_mask"][i] == 0 or not tokens:
            continue
        values = [float(value(i, t)) for t in tokens]
        total += sum(values) if cfg.token_level_loss else sum(values) / len(values)
    return total / float(n_toks if cfg.token_level_loss else n_seqs)


def sequence_mean(batch: Batch, of_sequence, value) -> float:
    """The mean over valid sequences of ``of_sequence([value(i, t) for its tokens])``."""
    n_seqs, _ = global_counts(batch)
    total = 0.0
    for i in range(batch["token_mask"].shape[0]):
        tokens = [t for t in range(batch["token_mask"].shape[1]) if batch["token_mask"][i, t] > 0]
        if batch["sample_mask"][i] > 0:
            total += of_sequence([value(i, t) for t in tokens])
    return total / float(n_seqs)


@pytest.mark.parametrize("token_level", [True, False])
def test_metrics_match_loops(token_level):
    cfg = ClippedPGConfig(
        token_level_loss=token_level,
        ratio_clip_low=0.1,
        ratio_clip_high=0.25,
        dual_clip_c=1.5,
        kl_penalty=0.1,
        importance_sampling_correction="tis",
        is_min=0.8,
        is_max=1.2,
    )
    lp, batch = make_case(seed=3, batch_size=5)
    seqs, toks = global_counts(batch)
    _, metrics = ClippedPGLoss(cfg)(lp, batch, seqs, toks)
    lp = lp.detach()

    def adv(i, t):
        return float(batch["advantages"][i])

    def ratio(i, t):
        return math.exp(float(lp[i, t] - batch["prev_logprobs"][i, t]))

    def raw_w(i, t):
        return math.exp(float(batch["prev_logprobs"][i, t] - batch["generation_logprobs"][i, t]))

    def log_ref_ratio(i, t):
        return float(batch["reference_logprobs"][i, t] - lp[i, t])

    valid = [
        (i, t)
        for i in range(lp.shape[0])
        for t in range(lp.shape[1])
        if batch["token_mask"][i, t] > 0 and batch["sample_mask"][i] > 0
    ]
    expected = {
        "ratio_mean": loop_reduce(cfg, batch, ratio),
        "ratio_min": min(ratio(i, t) for i, t in valid),
        "ratio_max": max(ratio(i, t) for i, t in valid),
        "clip_fraction_low": loop_reduce(cfg, batch, lambda i, t: adv(i, t) < 0 and ratio(i, t) < 0.9),
        "clip_fraction_high": loop_reduce(cfg, batch, lambda i, t: adv(i, t) > 0 and ratio(i, t) > 1.25),
        "dual_clip_fraction": loop_reduce(cfg, batch, lambda i, t: adv(i, t) < 0 and max(ratio(i, t), 0.9) > 1.5),
        "is_weight_mean": loop_reduce(cfg, batch, lambda i, t: min(max(raw_w(i, t), 0.8), 1.2)),
        "is_weight_max": max(min(max(raw_w(i, t), 0.8), 1.2) for i, t in valid),
        "is_oob_fraction": loop_reduce(cfg, batch, lambda i, t: not 0.8 <= raw_w(i, t) <= 1.2),
        "kl": loop_reduce(cfg, batch, lambda i, t: math.exp(log_ref_ratio(i, t)) - 1 - log_ref_ratio(i, t)),
        "token_mult_prob_error": loop_reduce(
            cfg, batch, lambda i, t: 1 / raw_w(i, t) if raw_w(i, t) < 1 else raw_w(i, t)
        ),
        "approx_entropy": loop_reduce(
            cfg,
            batch,
            lambda i, t: -math.exp(float(lp[i, t] - batch["generation_logprobs"][i, t])) * float(lp[i, t]),
        ),
        "mismatch_kl": loop_reduce(cfg, batch, lambda i, t: raw_w(i, t) - 1 - math.log(raw_w(i, t))),
        "mismatch_chi2_token": loop_reduce(cfg, batch, lambda i, t: raw_w(i, t) ** 2 - 1),
        "mismatch_chi2_sequence": sequence_mean(batch, lambda ws: math.prod(ws) ** 2 - 1, raw_w),
        "mismatch_ppl_ratio": sequence_mean(batch, lambda ws: math.prod(ws) ** (-1 / len(ws)), raw_w),
    }
    expected["kl_penalty"] = 0.1 * expected["kl"]
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert 0 < metrics["dual_clip_fraction"] < 1 and 0 < metrics["clip_fraction_high"] < 1


def test_kl_metric_reported_without_penalty_when_reference_present():
    lp, batch = make_case(seed=5)
    seqs, toks = global_counts(batch)
    loss_off, metrics = ClippedPGLoss(ClippedPGConfig(kl_penalty=0.0))(lp, batch, seqs, toks)
    assert metrics["kl"] > 0 and metrics["kl_penalty"] == 0.0
    del batch["reference_logprobs"]
    loss_without, metrics_without = ClippedPGLoss(ClippedPGConfig(kl_penalty=0.0))(lp, batch, seqs, toks)
    assert "kl" not in metrics_without
    torch.testing.assert_close(loss_off, loss_without)


# ----------------------------------------------------------------------------- global normalisation


@pytest.mark.parametrize(
    "options",
    [
        {"kl_penalty": 0.1, "dual_clip_c": 1.5, "importance_sampling_correction": "tis", "is_max": 1.2},
        {**SEQ, "kl_penalty": 0.1, "importance_sampling_correction": "seq_mask_tis", "is_min": 0.93, "is_max": 1.07},
        {**SEQ, "sequence_level_ratio": True, "ratio_clip_low": 0.05, "ratio_clip_high": 0.08},
        {"policy_loss": "cispo", "kl_penalty": 0.1, "kl_importance_weight": "generation",
         "importance_sampling_correction": "sequence_mask", "is_max": 2.0},
        {**SEQ, "policy_loss": "sapo", "kl_penalty": 0.1, "kl_in_reward": "return_to_go"},
        {"token_normalizer": "constant", "constant_normalizer": 12, "rollout_correction": "bypass"},
    ],
    ids=["token_level", "sequence_level", "gspo", "cispo", "sapo", "dr_grpo_bypass"],
)
def test_microbatches_sum_to_the_full_batch(options):
    loss_fn = ClippedPGLoss(ClippedPGConfig(**options))
    lp, batch = make_case(seed=11, batch_size=6)
    seqs, toks = global_counts(batch)  # counted once over the global batch, as a policy does

    full_loss, full_metrics = loss_fn(lp, batch, seqs, toks)
    (full_grad,) = torch.autograd.grad(full_loss, lp)

    parts, losses = [], []
    for start in range(0, 6, 2):
        loss, metrics = loss_fn(lp[start : start + 2], batch.slice(start, start + 2), seqs, toks)
        losses.append(loss)
        parts.append(metrics)
    (split_grad,) = torch.autograd.grad(sum(losses), lp)

    torch.testing.assert_close(sum(losses), full_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-14)
    combined = combine_metrics(parts, loss_fn.metric_reductions)
    assert combined.keys() == full_metrics.keys()
    for name, value in full_metrics.items():
        assert combined[name] == pytest.approx(value, rel=1e-10, abs=1e-14), name


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
def test_microbatch_normalizer_is_each_microbatchs_token_mean(policy_loss):
    """token_normalizer=microbatch (TRL's bnpo): each microbatch contributes its own token mean
    times its share of the global valid sequences, so microbatches of equal size average their
    token means; with one microbatch it is the global token mean."""
    cfg = ClippedPGConfig(policy_loss=policy_loss, token_normalizer="microbatch")
    global_mean = ClippedPGLoss(attrs.evolve(cfg, token_normalizer="global"))
    loss_fn = ClippedPGLoss(cfg)
    lp, batch = make_case(seed=11, batch_size=6, drop_last=False)
    seqs, toks = global_counts(batch)
    torch.testing.assert_close(loss_fn(lp, batch, seqs, toks)[0], global_mean(lp, batch, seqs, toks)[0])
    total, expected = 0.0, 0.0
    for start in range(0, 6, 2):
        part = batch.slice(start, start + 2)
        part_seqs, part_toks = global_counts(part)
        total = total + loss_fn(lp[start : start + 2], part, seqs, toks)[0]
        expected = expected + global_mean(lp[start : start + 2], part, part_seqs, part_toks)[0] / 3
    (grad,) = torch.autograd.grad(total, lp)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(total, global_mean(lp, batch, seqs, toks)[0])  # unequal token counts: not the same


def test_bypass_trains_against_the_engines_logprobs():
    """rollout_correction=bypass: the ratio is exp(logp - generation_logprobs), whatever the
    batch's prev_logprobs hold; the mismatch metrics compare the trained logprobs with the engine's."""
    cfg = ClippedPGConfig(rollout_correction="bypass")
    lp, batch = make_case(seed=BRANCH_SEED)
    seqs, toks = global_counts(batch)
    explicit = Batch(**{**{k: batch[k] for k in batch.keys()}, "prev_logprobs": batch["generation_logprobs"]})
    want, want_metrics = ClippedPGLoss(ClippedPGConfig())(lp, explicit, seqs, toks)
    for prev in (batch["prev_logprobs"], batch["prev_logprobs"] - 5.0):
        given = Batch(**{**{k: batch[k] for k in batch.keys()}, "prev_logprobs": prev})
        loss, metrics = ClippedPGLoss(cfg)(lp, given, seqs, toks)
        torch.testing.assert_close(loss, want, rtol=0, atol=0)
        assert metrics["ratio_mean"] == want_metrics["ratio_mean"]
    on_policy = Batch(**{k: batch[k] for k in batch.keys() if k != "prev_logprobs"})
    assert metrics["token_mult_prob_error"] == ClippedPGLoss(ClippedPGConfig())(lp, on_policy, seqs, toks)[1][
        "token_mult_prob_error"]


def test_microbatch_without_valid_tokens_contributes_nothing():
    loss_fn = ClippedPGLoss(ClippedPGConfig())
    lp, batch = make_case(seed=2, batch_size=4)  # the last sample has sample_mask 0
    seqs, toks = global_counts(batch)
    loss, metrics = loss_fn(lp[3:], batch.slice(3, 4), seqs, toks)
    assert float(loss.detach()) == 0.0 and metrics["ratio_max"] == -math.inf and metrics["ratio_min"] == math.inf
    combined = combine_metrics([loss_fn(lp[:3], batch.slice(0, 3), seqs, toks)[1], metrics], loss_fn.metric_reductions)
    assert math.isfinite(combined["ratio_max"]) and math.isfinite(combined["ratio_min"])


# ----------------------------------------------------------------------------- contract details


def test_padding_values_never_reach_loss_or_gradient():
    lp, batch = make_case(seed=4)
    seqs, toks = global_counts(batch)
    garbage = lp.detach().clone()
    garbage[batch["token_mask"] == 0] = -math.inf  # a policy that left -inf on padding
    garbage.requires_grad_()
    cfg = ClippedPGConfig(kl_penalty=0.1, importance_sampling_correction="icepop", is_min=0.5, is_max=2.0)
    loss, metrics = ClippedPGLoss(cfg)(garbage, batch, seqs, toks)
    (grad,) = torch.autograd.grad(loss, garbage)
    clean_loss, _ = ClippedPGLoss(cfg)(lp, batch, seqs, toks)
    assert torch.isfinite(grad).all() and all(math.isfinite(v) for v in metrics.values())
    torch.testing.assert_close(loss, clean_loss)


def test_loss_type_follows_normalisation():
    assert ClippedPGLoss(ClippedPGConfig()).loss_type is LossType.TOKEN
    assert ClippedPGLoss(ClippedPGConfig(token_level_loss=False)).loss_type is LossType.SEQUENCE


def test_constructor_refuses_invalid_options():
    with pytest.raises(ConfigError, match="grpo.loss.sequence_level_ratio: GSPO"):
        ClippedPGLoss(attrs.evolve(ClippedPGConfig(), sequence_level_ratio=True))


def test_reinforce_is_minus_advantage_times_logprob_by_hand():
    """Two samples, hand arithmetic: tokens (A=2: lp -1, -2), (A=-1: lp -0.5), sample
    normalisation -> (mean(2, 4) + mean(-0.5)) / 2 = (3 - 0.5) / 2 = 1.25."""
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], dtype=F64, requires_grad=True)
    batch = Batch(
        token_mask=torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=F64),
        sample_mask=torch.ones(2, dtype=F64),
        advantages=torch.tensor([2.0, -1.0], dtype=F64),
        prev_logprobs=lp.detach().clone(),
    )
    cfg = ClippedPGConfig(disable_ppo_ratio=True, token_level_loss=False)
    loss, _ = ClippedPGLoss(cfg)(lp, batch, torch.tensor(2.0), torch.tensor(3.0))
    assert float(loss.detach()) == pytest.approx(1.25)
    (grad,) = torch.autograd.grad(loss, lp)
    # d/dlp of -A*lp/(len*N): sample 0: -2/(2*2) = -0.5 per token; sample 1: 1/(1*2) = 0.5.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -0.5], [0.0, 0.5, 0.0]], dtype=F64))


def test_float32_inputs_as_a_policy_sends_them():
    cfg = ClippedPGConfig(**CASES["everything"])
    lp, batch = make_case(seed=BRANCH_SEED)
    seqs, toks = global_counts(batch)
    batch32 = Batch({name: value.float() for name, value in batch.items()})
    loss32, _ = ClippedPGLoss(cfg)(lp.detach().float().requires_grad_(), batch32, seqs.float(), toks.float())
    assert loss32.dtype == torch.float32
    assert float(loss32.detach()) == pytest.approx(float(reference_loss(cfg, lp, batch).detach()), rel=1e-5)


@pytest.mark.parametrize("name", ["ppo_token_level", "dual_clip", "gspo", "tis", "everything"])
def test_without_prev_logprobs_the_loss_is_on_policy(name):
    """No ``prev_logprobs`` field: the same loss and gradient as with ``prev_logprobs`` equal
    to the logprobs being trained (what the skipped pass would have computed), and r = 1."""
    cfg = ClippedPGConfig(**CASES[name])
    lp, batch = make_case(seed=BRANCH_SEED)
    seqs, toks = global_counts(batch)
    on_policy = Batch(**{k: batch[k] for k in batch.keys() if k != "prev_logprobs"})
    explicit = Batch(**{k: batch[k] for k in on_policy.keys()},
                     prev_logprobs=torch.where(batch["token_mask"] > 0, lp.detach(), -math.inf))
    loss, metrics = ClippedPGLoss(cfg)(lp, on_policy, seqs, toks)
    want, want_metrics = ClippedPGLoss(cfg)(lp, explicit, seqs, toks)
    (grad,) = torch.autograd.grad(loss, lp)
    (want_grad,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    assert grad.abs().sum() > 0
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0 == want_metrics["ratio_max"]
