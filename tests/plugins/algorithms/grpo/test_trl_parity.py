"""GRPO's loss and advantages against TRL 1.16's ``GRPOTrainer``, in float64.

The loss: TRL's own ``GRPOTrainer._compute_loss`` runs on a prepared batch, with the
trainer's logprob pass replaced by a leaf tensor, so its loss and our ``clipped_pg`` are
functions of the same logprobs and their gradients compare directly. Batches are TRL's
layout (completion tokens only, ``completion_mask`` padding each row to its own length),
split into 1, 2 and 3 microbatches as TRL's gradient accumulation runs them.

TRL's vLLM importance-sampling weights (``vllm_importance_sampling_mode``) are computed when
TRL generates, outside ``_compute_loss``; :func:`trl_vllm_weights` writes them from TRL's
formulas and hands them to ``_compute_loss`` as TRL would. TRL's advantages are likewise
computed while it generates: :func:`trl_advantages` is written from its formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.batch import Batch
from posttrain_grpo.advantages import compute_advantages, consecutive_group_ids
from posttrain_grpo.config import ClippedPGConfig
from posttrain_grpo.loss import ClippedPGLoss

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl", reason="TRL is not installed; the parity tests need trl (1.16)")

F64 = torch.float64
ROWS, WIDTH = 6, 7


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_lm):
    """One GRPOTrainer (tiny model, no reference model: the KL reads the batch's reference
    logprobs), reconfigured per case through the attributes ``_compute_loss`` reads."""
    from datasets import Dataset

    from posttrain.models.tiny import build_tokenizer

    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), beta=0.0, report_to=[], use_cpu=True, bf16=False,
        per_device_train_batch_size=ROWS, num_generations=ROWS, max_completion_length=WIDTH,
    )
    trainer = trl.GRPOTrainer(
        model=tiny_lm(0), reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_list([{"prompt": "a"}] * ROWS), processing_class=build_tokenizer(),
    )
    trainer.model.train()
    return trainer


def configure(trainer, *, loss_type: str, epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
              bias_correction: bool = True, level: str = "token", vllm_is: bool = False, **sapo) -> None:
    trainer.loss_type = loss_type
    trainer.epsilon_low, trainer.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    trainer.beta = beta
    trainer.args.use_bias_correction_kl = bias_correction
    trainer.importance_sampling_level = level
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm_is
    trainer.max_completion_length = WIDTH
    trainer.args.sapo_temperature_pos = sapo.get("pos", 1.0)
    trainer.args.sapo_temperature_neg = sapo.get("neg", 1.05)


def make_rows(seed: int) -> dict[str, torch.Tensor]:
    """Completion-only rows: each of its own length, logprobs and advantages drawn so that
    both clip sides bind."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, WIDTH + 1, (ROWS,), generator=g)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
    lp = -(torch.rand(ROWS, WIDTH, generator=g, dtype=F64) * 2 + 0.05)
    old = lp + 0.3 * torch.randn(ROWS, WIDTH, generator=g, dtype=F64)
    sampling = old + 0.35 * torch.randn(ROWS, WIDTH, generator=g, dtype=F64)
    ref = lp + 0.4 * torch.randn(ROWS, WIDTH, generator=g, dtype=F64)
    advantages = torch.randn(ROWS, generator=g, dtype=F64)
    return dict(lp=lp, mask=mask, old=old, sampling=sampling, ref=ref, advantages=advantages)


def trl_vllm_weights(old, sampling, mask, mode: str, clip_min, clip_max):
    """TRL's vLLM importance-sampling ratio: per token, or one per sequence (the product of
    the token ratios); NaN engine logprobs count as ratio 1; truncated or masked to the bounds."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def trl_loss(trainer, lp, rows, start, stop, parts, is_weights=None):
    """TRL's _compute_loss on rows [start, stop) of one of ``parts`` accumulation steps."""
    trainer.current_gradient_accumulation_steps = parts
    trainer.args.steps_per_generation = parts
    inputs = dict(
        prompt_ids=torch.zeros(stop - start, 1, dtype=torch.long), prompt_mask=torch.ones(stop - start, 1, dtype=torch.long),
        completion_ids=torch.zeros(stop - start, WIDTH, dtype=torch.long), completion_mask=rows["mask"][start:stop],
        advantages=rows["advantages"][start:stop], old_per_token_logps=rows["old"][start:stop],
        ref_per_token_logps=rows["ref"][start:stop], num_items_in_batch=rows["mask"].sum().to(F64),
    )
    if is_weights is not None:
        inputs["importance_sampling_ratio"] = is_weights[start:stop]
    part = lp[start:stop]
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (part, torch.zeros_like(part), None)
    return trainer._compute_loss(trainer.model, inputs)


def our_batch(rows) -> Batch:
    mask = rows["mask"].to(F64)
    return Batch(token_mask=mask, sample_mask=torch.ones(ROWS, dtype=F64), advantages=rows["advantages"],
                 prev_logprobs=rows["old"], generation_logprobs=rows["sampling"], reference_logprobs=rows["ref"])


#: name: (TRL's GRPOConfig options as trainer attributes, posttrain's grpo.loss options)
CASES = {
    "grpo": ({"loss_type": "grpo"}, {"token_level_loss": False}),
    "dapo_clip_higher": ({"loss_type": "dapo", "epsilon_high": 0.28}, {"ratio_clip_high": 0.28}),
    "bnpo": ({"loss_type": "bnpo"}, {"token_normalizer": "microbatch"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"token_normalizer": "constant", "constant_normalizer": WIDTH}),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, {"policy_loss": "cispo", "ratio_clip_low": 1.0,
                                                            "ratio_clip_high": 0.3}),
    # temperatures exact in float32: TRL builds its temperature tensor from Python floats, in float32
    "sapo": ({"loss_type": "sapo", "pos": 1.5, "neg": 0.75},
             {"policy_loss": "sapo", "token_level_loss": False, "sapo_temperature_pos": 1.5,
              "sapo_temperature_neg": 0.75}),
    "gspo": ({"loss_type": "grpo", "level": "sequence", "epsilon": 0.05},
             {"token_level_loss": False, "sequence_level_ratio": True, "ratio_clip_low": 0.05, "ratio_clip_high": 0.05}),
    "kl_direct_k3": ({"loss_type": "dapo", "beta": 0.2, "bias_correction": False},
                     {"kl_penalty": 0.2, "kl_importance_weight": "none", "kl_input_clamp": None,
                      "kl_output_clamp": None}),
    "kl_bias_correction": ({"loss_type": "dapo", "beta": 0.2},
                           {"kl_penalty": 0.2, "kl_importance_weight": "prev", "kl_input_clamp": None,
                            "kl_output_clamp": None}),
    "kl_gspo_bias_correction": ({"loss_type": "grpo", "level": "sequence", "beta": 0.2},
                                {"token_level_loss": False, "sequence_level_ratio": True, "kl_penalty": 0.2,
                                 "kl_importance_weight": "prev", "kl_input_clamp": None, "kl_output_clamp": None}),
}


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_clipped_pg_matches_trl(trainer, name, parts):
    theirs_options, ours = CASES[name]
    configure(trainer, **theirs_options)
    for seed in range(3):
        rows = make_rows(seed)
        assert_parity(trainer, rows, ClippedPGConfig(**ours), parts)


def assert_parity(trainer, rows, cfg: ClippedPGConfig, parts: int, is_weights=None) -> None:
    size = ROWS // parts
    batch = our_batch(rows)
    seqs, toks = batch["sample_mask"].sum(), batch["token_mask"].sum()
    loss_fn = ClippedPGLoss(cfg)
    lp = rows["lp"].clone().requires_grad_()
    theirs = sum(trl_loss(trainer, lp, rows, i * size, (i + 1) * size, parts, is_weights) for i in range(parts))
    ours = sum(loss_fn(lp[i * size:(i + 1) * size], batch.slice(i * size, (i + 1) * size), seqs, toks)[0]
               for i in range(parts))
    (their_grad,) = torch.autograd.grad(theirs, lp)
    (our_grad,) = torch.autograd.grad(ours, lp)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-10, atol=1e-14)
    assert our_grad.abs().sum() > 0


#: TRL's vllm_importance_sampling_mode with its bounds: posttrain's correction
IS_MODES = {
    ("token_truncate", None, 1.2): {"importance_sampling_correction": "tis", "is_max": 1.2},
    ("token_mask", 0.8, 1.25): {"importance_sampling_correction": "icepop", "is_min": 0.8, "is_max": 1.25},
    ("sequence_truncate", None, 1.5): {"importance_sampling_correction": "sequence_truncate", "is_max": 1.5},
    ("sequence_mask", None, 3.0): {"importance_sampling_correction": "sequence_mask", "is_max": 3.0},  # TRL's default
    ("sequence_mask", 0.5, 1.5): {"importance_sampling_correction": "sequence_mask", "is_min": 0.5, "is_max": 1.5},
}


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("mode", list(IS_MODES), ids=lambda mode: "-".join(map(str, mode)))
def test_vllm_importance_sampling_matches_trl(trainer, mode, parts):
    configure(trainer, loss_type="dapo", vllm_is=True)
    kind, clip_min, clip_max = mode
    exercised = False
    for seed in range(4, 8):  # seeds whose sequence weights reach TRL's default bound, 3
        rows = make_rows(seed)
        weights = trl_vllm_weights(rows["old"], rows["sampling"], rows["mask"], kind, clip_min, clip_max)
        exercised |= bool(((weights == 0) | (weights == clip_max)).any())
        assert_parity(trainer, rows, ClippedPGConfig(**IS_MODES[mode]), parts, weights)
    assert exercised, "no weight reached a bound"


def test_nan_engine_logprobs_are_trls_neutral_tokens(trainer):
    """TRL counts a token whose engine logprob is NaN as ratio 1 (our neutral_token)."""
    configure(trainer, loss_type="dapo", vllm_is=True)
    rows = make_rows(5)
    rows["sampling"][0, 0] = rows["sampling"][3, 1] = math.nan
    for kind, ours in (("token_mask", {"importance_sampling_correction": "icepop", "is_min": 0.5, "is_max": 2.0}),
                       ("sequence_mask", {"importance_sampling_correction": "sequence_mask", "is_max": 3.0})):
        weights = trl_vllm_weights(rows["old"], rows["sampling"], rows["mask"], kind, ours.get("is_min"), ours["is_max"])
        cfg = ClippedPGConfig(**ours, nonfinite_generation_logprobs="neutral_token")
        assert_parity(trainer, rows, cfg, 2, weights)


# ----------------------------------------------------------------------------- advantages


def trl_advantages(rewards, group: int, scale: str, eps: float = 1e-4):
    """TRL's sum_then_normalize advantages: reward minus the group mean, divided by the group's
    (or the batch's) unbiased std plus eps, or not divided (scale_rewards none)."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    if scale == "group":
        std = grouped.std(dim=1).repeat_interleave(group)
    else:
        std = rewards.std().expand_as(rewards)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + eps)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(scale):
    """scale_rewards group | batch | none: the mean baseline with advantage_std_epsilon 1e-4
    and reward_std_scope group or batch, or normalize_rewards false."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (24,), generator=g).to(F64) / 2
    rewards[4:8] = 1.0  # a group without signal: 0 in both (TRL divides 0 by eps)
    groups = consecutive_group_ids(24, 4)
    ours = compute_advantages(rewards, groups, leave_one_out=False, normalize=scale != "none",
                              std_scope="batch" if scale == "batch" else "group", std_epsilon=1e-4)
    torch.testing.assert_close(ours, trl_advantages(rewards, 4, scale), rtol=1e-12, atol=1e-15)


def test_normalize_then_sum_matches_trl():
    """TRL's multi_objective_aggregation=normalize_then_sum (GDPO): each reward function's
    (r - group mean) / (group std + 1e-4), the weighted sum, then (sum - mean) / (std + 1e-4)
    over the batch. posttrain's last division has no epsilon (NeMo RL's): relative differences
    of about 1e-4 / std remain."""
    from posttrain_grpo.advantages import normalize_then_sum

    g = torch.Generator().manual_seed(1)
    parts = torch.stack([torch.randint(0, 2, (24,), generator=g).to(F64),
                         torch.rand(24, generator=g, dtype=F64)], dim=1)
    weights = (1.0, 0.5)
    grouped = parts.view(-1, 4, 2)
    normalized = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
    total = (normalized.view(-1, 2) * torch.tensor(weights, dtype=F64)).sum(dim=1)
    theirs = (total - total.mean()) / (total.std() + 1e-4)
    ours = normalize_then_sum(parts, consecutive_group_ids(24, 4), weights, leave_one_out=False, normalize=True,
                              std_epsilon=1e-4)
    torch.testing.assert_close(ours, theirs, rtol=2e-4, atol=1e-6)
