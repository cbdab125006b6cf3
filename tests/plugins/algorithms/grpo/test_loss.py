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
        seq_log_ratio = sum(lp[i, t] - p for t, p in zip(tokens, prev, strict=True)) / len(tokens)
        seq_log_w = sum(p - q for p, q in zip(prev, gen, strict=True)) / len(tokens)
        terms = []
        for k, t in enumerate(tokens):
            adv = float(batch["advantages"][i, t] if batch["advantages"].dim() == 2 else batch["advantages"][i])
            if cfg.disable_ppo_ratio:
                term = -adv * lp[i, t]
            else:
                ratio = torch.exp(seq_log_ratio if cfg.sequence_level_ratio else lp[i, t] - prev[k])
                clipped = torch.clamp(ratio, 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high)
                unclipped_loss, clipped_loss = -adv * ratio, -adv * clipped
                term = unclipped_loss if unclipped_loss >= clipped_loss else clipped_loss
                if cfg.dual_clip_c is not None and adv < 0 and term > -cfg.dual_clip_c * adv:
                    term = torch.tensor(-cfg.dual_clip_c * adv, dtype=F64)
            if cfg.importance_sampling_correction is not None:
                term = term * reference_is_weight(cfg, prev[k] - gen[k], seq_log_w)
            if cfg.kl_penalty > 0:
                term = term + cfg.kl_penalty * reference_kl(cfg, float(batch["reference_logprobs"][i, t]), lp[i, t])
            terms.append(term)
        total = total + (sum(terms) if cfg.token_level_loss else sum(terms) / len(terms))
    return total / (n_toks if cfg.token_level_loss else n_seqs)


def reference_is_weight(cfg: ClippedPGConfig, token_log_w: float, seq_log_w: float) -> float:
    log_w = seq_log_w if cfg.sequence_level_ratio else token_log_w
    w = math.exp(log_w)
    low = cfg.is_min if cfg.is_min is not None else 0.0
    if cfg.importance_sampling_correction == "tis":
        return min(max(w, low), cfg.is_max)
    if cfg.importance_sampling_correction == "icepop":
        return w if low <= w <= cfg.is_max else 0.0
    geometric_mean = math.exp(seq_log_w)  # seq_mask_tis
    return w if low <= geometric_mean <= cfg.is_max else 0.0


def reference_kl(cfg: ClippedPGConfig, ref: float, lp: torch.Tensor) -> torch.Tensor:
    """The estimate with its score-function term; a token where a clamp binds is a constant
    (value only, no gradient of any kind)."""
    x = ref - lp  # log(pi_ref / pi)
    if cfg.kl_input_clamp is not None and abs(float(x)) > cfg.kl_input_clamp:
        x = torch.tensor(math.copysign(cfg.kl_input_clamp, float(x)), dtype=F64)
    if cfg.kl_estimator == "k1":
        k = -x
    elif cfg.kl_estimator == "k2":
        k = 0.5 * x * x
    else:
        k = torch.exp(x) - 1 - x
    if cfg.kl_output_clamp is not None and abs(float(k)) > cfg.kl_output_clamp:
        return torch.tensor(math.copysign(cfg.kl_output_clamp, float(k)), dtype=F64)
    if not x.requires_grad:  # the input clamp bound
        return x.new_tensor(float(k))
    return k + k.detach() * (lp - lp.detach())


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
    "name", ["ppo_token_level", "asymmetric_clip", "dual_clip", "gspo", "reinforce_sequence", "tis", "seq_mask_tis"]
)
def test_gradcheck(name):
    """Finite differences agree with autograd (KL cases excluded: their score-function term
    is invisible to finite differences by design)."""
    cfg = ClippedPGConfig(**CASES[name])
    loss_fn = ClippedPGLoss(cfg)
    lp, batch = make_case(seed=7, batch_size=3, seq_len=6)
    seqs, toks = global_counts(batch)
    assert torch.autograd.gradcheck(lambda x: loss_fn(x, batch, seqs, toks)[0], (lp,), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- KL gradient


def one_token_kl_gradient(logp: float, ref: float, **options) -> float:
    """d loss / d logp of the KL term alone (beta 1, no advantage) for one sampled token."""
    lp = torch.tensor([[logp]], dtype=F64, requires_grad=True)
    batch = Batch(
        token_mask=torch.ones(1, 1, dtype=F64),
        sample_mask=torch.ones(1, dtype=F64),
        advantages=torch.zeros(1, dtype=F64),
        reference_logprobs=torch.tensor([[ref]], dtype=F64),
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
    ],
    ids=["token_level", "sequence_level", "gspo"],
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
