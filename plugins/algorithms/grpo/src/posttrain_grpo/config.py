"""Typed options of GRPO (section ``grpo``) and of its clipped policy-gradient loss
(``grpo.loss``). Invalid combinations are refused by :mod:`posttrain_grpo.validation`.
"""

from __future__ import annotations

from typing import Literal

import attrs

Baseline = Literal["mean", "leave_one_out"]
KLEstimator = Literal["k1", "k2", "k3"]
ISCorrection = Literal["tis", "icepop", "seq_mask_tis"]


@attrs.define
class ClippedPGConfig:
    """PPO-style clipped policy gradient with its variants (options of ``clipped_pg``).

    Ratios are ``exp(logp_current - logp_prev)`` where ``prev`` is the trainer's own
    logprob before this step's updates.
    """

    ratio_clip_low: float = 0.2  # ratio clipped below at 1 - ratio_clip_low
    ratio_clip_high: float = 0.2  # ratio clipped above at 1 + ratio_clip_high (DAPO clip-higher: 0.28)
    dual_clip_c: float | None = None  # > 1: for negative advantages the loss is at most c * |A|
    token_level_loss: bool = True  # False: mean over each sequence's tokens, then over sequences
    kl_penalty: float = 0.0  # beta of the KL-to-reference term; 0 turns it off
    kl_estimator: KLEstimator = "k3"
    kl_input_clamp: float | None = 20.0  # |log(ref/current)| clamp before the estimator
    kl_output_clamp: float | None = 10.0  # |estimate| clamp after it
    # Train/inference mismatch correction, weights exp(logp_prev - logp_generation):
    # tis truncates the weights to [is_min, is_max] (is_min optional); icepop zeroes tokens
    # whose weight is outside [is_min, is_max]; seq_mask_tis zeroes whole sequences whose
    # geometric-mean weight is outside it and keeps the raw token weights elsewhere.
    importance_sampling_correction: ISCorrection | None = None
    is_min: float | None = None
    is_max: float | None = None
    sequence_level_ratio: bool = False  # GSPO: one length-normalised ratio per sequence
    disable_ppo_ratio: bool = False  # REINFORCE / RLOO: loss = -A * logp, no ratio, no clip


@attrs.define
class RewardScalingConfig:
    """Linear map of rewards from [source_min, source_max] (clamped) onto
    [target_min, target_max], applied before anything else uses them."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


@attrs.define
class DynamicSamplingConfig:
    """DAPO dynamic sampling: train only on prompt groups whose rewards are not all equal,
    generating more batches (at most ``max_gen_batches`` per step) to fill the step."""

    enabled: bool = False
    max_gen_batches: int = 10


@attrs.define
class OverlongRewardShapingConfig:
    """DAPO soft overlong punishment: a response longer than
    ``max_response_length - buffer_length`` tokens loses up to ``penalty`` reward,
    linearly in the excess length."""

    enabled: bool = False
    buffer_length: int = 128  # tokens
    penalty: float = 1.0
    max_response_length: int | None = None  # tokens; None: generation.max_new_tokens


@attrs.define
class GRPOConfig:
    """Group relative policy optimisation (and DAPO, GSPO, RLOO through the options)."""

    num_prompts_per_step: int = 32
    num_generations_per_prompt: int = 16
    max_num_steps: int = 1_000_000  # 0: validate only (with val_at_start), no training
    max_num_epochs: int = 1
    val_period: int = 0  # steps between validations; 0: never
    val_at_start: bool = False
    max_val_samples: int | None = None  # validation prompts used per validation; None: all
    max_rollout_turns: int = 1
    baseline: Baseline = "leave_one_out"
    normalize_rewards: bool = True  # divide advantages by the group's reward std where it is > 0
    advantage_clip_low: float | None = None  # advantages clamped to [low, high]; None: no bound
    advantage_clip_high: float | None = None
    reward_scaling: RewardScalingConfig = attrs.field(factory=RewardScalingConfig)
    dynamic_sampling: DynamicSamplingConfig = attrs.field(factory=DynamicSamplingConfig)
    overlong_filtering: bool = False  # truncated responses stay in baselines but get no gradient
    overlong_reward_shaping: OverlongRewardShapingConfig = attrs.field(factory=OverlongRewardShapingConfig)
    skip_reference_logprobs_when_kl_off: bool = True
    # With one optimizer step per step's batch the policy that generated is the one that
    # trains, so prev_logprobs are the training pass's own logprobs (detached): no extra pass.
    skip_prev_logprobs_when_on_policy: bool = True
    loss: ClippedPGConfig = attrs.field(factory=ClippedPGConfig)
    export_dir: str | None = None  # write a Hugging Face folder of the final weights here

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt
