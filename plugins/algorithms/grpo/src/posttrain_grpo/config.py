"""Typed options of GRPO (section ``grpo``) and of its clipped policy-gradient loss
(``grpo.loss``). Invalid combinations are refused by :mod:`posttrain_grpo.validation`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs

from posttrain.config.demands import Demand, generation_demand, policy_demand
from posttrain.config.schema import RunConfig
from posttrain.config.validate import BatchSizeRules

Baseline = Literal["mean", "leave_one_out", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
ISCorrection = Literal["tis", "icepop", "seq_mask_tis", "sequence_truncate", "sequence_mask"]
PolicyLoss = Literal["ppo", "cispo", "sapo"]
TokenNormalizer = Literal["global", "constant", "microbatch"]
KLImportanceWeight = Literal["on_policy", "none", "prev", "generation"]
KLInReward = Literal["token", "return_to_go"]
SequenceISWeight = Literal["geometric_mean", "product"]
NonfiniteGeneration = Literal["drop_sequence", "drop_token", "neutral_token"]
RolloutCorrection = Literal["decoupled", "bypass"]
RewardStdScope = Literal["group", "batch"]
AdvantageWhitening = Literal["samples", "tokens"]
RewardAggregation = Literal["sum", "normalize_then_sum"]
OverlongBeyondMax = Literal["capped", "linear"]


@attrs.define
class ClippedPGConfig:
    """PPO-style clipped policy gradient with its variants (options of ``clipped_pg``).

    Ratios are ``exp(logp_current - logp_prev)`` where ``prev`` is the proximal policy's
    logprob: the trainer's own before this step's updates (``rollout_correction: decoupled``)
    or the generation engine's (``bypass``). Every option's formula, with the NeMo RL and TRL
    option it corresponds to: docs/algorithms/loss-reference.md.
    """

    # ppo: the clipped ratio objective; cispo: sg(clip(r)) * A * logp (MiniMax-M1's CISPO);
    # sapo: a soft gate sigmoid(tau * (r - 1)) * 4 / tau in place of the clip (SAPO)
    policy_loss: PolicyLoss = "ppo"
    ratio_clip_low: float = 0.2  # ratio clipped below at 1 - ratio_clip_low (ppo, cispo)
    ratio_clip_high: float = 0.2  # ratio clipped above at 1 + ratio_clip_high (DAPO clip-higher: 0.28)
    dual_clip_c: float | None = None  # > 1: for negative advantages the loss is at most c * |A|; None: off
    sapo_temperature_pos: float = 1.0  # sapo: the gate's temperature tau for tokens with A > 0 (> 0)
    sapo_temperature_neg: float = 1.05  # sapo: the gate's temperature tau for tokens with A <= 0 (> 0)
    token_level_loss: bool = True  # False: mean over each sequence's tokens, then over sequences
    # with token_level_loss, what the summed token losses are divided by: global (the global batch's valid
    # tokens); constant (its valid sequences times constant_normalizer tokens: Dr. GRPO); microbatch (each
    # microbatch's own valid tokens, weighted by its share of the valid sequences: TRL's bnpo)
    token_normalizer: TokenNormalizer = "global"
    # tokens per sequence of token_normalizer=constant (> 0); None: generation.max_new_tokens
    constant_normalizer: int | None = None
    kl_penalty: float = 0.0  # beta of the KL-to-reference term; 0 turns it off
    # per-token estimate of KL(policy || reference) from lr = log(ref/current): k1 = -lr,
    # k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr
    kl_estimator: KLEstimator = "k3"
    # |log(ref/current)| clamp before the estimator (> 0; None: none); a token where it binds carries no gradient
    kl_input_clamp: float | None = 20.0
    # |weighted estimate| clamp after it (> 0; None: none); a token where it binds carries no gradient
    kl_output_clamp: float | None = 10.0
    # The weight w of each token's KL estimate k (the term is w * k), which sets the KL's gradient:
    # on_policy: exp(logp - sg(logp)), 1 in value: the reverse-KL gradient for tokens drawn from the policy;
    # none: w = 1, the estimator's own gradient (TRL use_bias_correction_kl=false); prev: the policy
    # ratio r (TRL's default); generation: exp(logp - logp_generation) (NeMo RL use_on_policy_kl_approximation)
    kl_importance_weight: KLImportanceWeight = "on_policy"
    # The KL penalty in the advantages instead of the loss (Reinforce++ / PPO style): token subtracts
    # kl_penalty * k_t from token t's advantage; return_to_go subtracts kl_penalty * sum_{s >= t} k_s; None: in the loss
    kl_in_reward: KLInReward | None = None
    # Train/inference mismatch correction, weights exp(logp_prev - logp_generation):
    # tis truncates the weights to [is_min, is_max] (is_min optional); icepop zeroes tokens
    # whose weight is outside [is_min, is_max]; seq_mask_tis zeroes whole sequences whose
    # geometric-mean weight is outside it and keeps the raw token weights elsewhere;
    # sequence_truncate weights every token of a sequence by the product of its token weights
    # truncated to [is_min, is_max]; sequence_mask by that product, zeroed outside the bounds (TRL's vLLM modes)
    importance_sampling_correction: ISCorrection | None = None
    # lower weight bound (>= 0); tis, sequence_*: optional (None: 0); icepop, seq_mask_tis: required
    is_min: float | None = None
    is_max: float | None = None  # upper weight bound (> 0), required by each correction; set neither without one
    # a loss token whose generation logprob is NaN or infinite: drop_sequence gives its whole sequence weight 0;
    # drop_token gives that token weight 0 (NeMo RL); neutral_token gives it weight 1 (TRL); a sequence
    # aggregate of weights counts such a token as weight 1 with drop_token and neutral_token
    nonfinite_generation_logprobs: NonfiniteGeneration = "drop_sequence"
    sequence_level_ratio: bool = False  # GSPO: one length-normalised ratio per sequence
    # with sequence_level_ratio, a sequence's train/inference weight: geometric_mean exp(mean_t(prev - gen)),
    # or product exp(sum_t(prev - gen)) (NeMo RL's GSPO)
    sequence_is_weight: SequenceISWeight = "geometric_mean"
    disable_ppo_ratio: bool = False  # REINFORCE / RLOO: loss = -A * logp, no ratio, no clip
    # decoupled: three policies, the ratio against the trainer's logprobs before the step's updates and the
    # mismatch corrected by importance_sampling_correction; bypass: the ratio against the generation engine's
    # logprobs (no previous-logprob pass, the clip bounds the mismatch; needs importance_sampling_correction null)
    rollout_correction: RolloutCorrection = "decoupled"


@attrs.define
class RewardScalingConfig:
    """Linear map of rewards from [source_min, source_max] (clamped) onto
    [target_min, target_max], applied before anything else uses them."""

    enabled: bool = False  # false: rewards as the environments give them
    source_min: float = 0.0  # rewards below it are raised to it, then mapped onto target_min
    source_max: float = 1.0  # rewards above it are lowered to it, then mapped onto target_max; > source_min
    target_min: float = 0.0  # what source_min maps to
    target_max: float = 1.0  # what source_max maps to


@attrs.define
class DynamicSamplingConfig:
    """DAPO dynamic sampling: train only on prompt groups whose rewards are not all equal,
    generating more batches (at most ``max_gen_batches`` per step) to fill the step."""

    enabled: bool = False  # needs num_generations_per_prompt >= 2
    # prompt batches rolled out per step at most; a step still short of num_prompts_per_step groups
    # with differing rewards after them stops the run with an error
    max_gen_batches: int = 10


@attrs.define
class OverlongRewardShapingConfig:
    """DAPO soft overlong punishment: a response longer than
    ``max_response_length - buffer_length`` tokens loses reward linearly in the excess
    length, ``penalty`` at ``max_response_length`` tokens."""

    enabled: bool = False  # add the penalty to the scaled rewards before the advantages
    buffer_length: int = 128  # tokens before max_response_length over which the penalty grows; 1..max_response_length
    penalty: float = 1.0  # reward lost at max_response_length tokens (>= 0)
    max_response_length: int | None = None  # tokens; None: generation.max_new_tokens
    # past max_response_length: capped keeps the penalty at penalty; linear lets it grow at the same
    # slope (NeMo RL's DAPO shaping, with responses longer than max_response_length)
    beyond_max: OverlongBeyondMax = "capped"


@attrs.define
class AgentConfig:
    """Rollouts by an agent written outside posttrain, through an OpenAI-compatible endpoint
    on the generation engines (``posttrain_grpo.agents``, ``posttrain_grpo.endpoint``)."""

    # "package.module:function" of the agent, called as agent(task, base_url) -> reward for each sample;
    # None: the environments roll out
    entry: str | None = None
    timeout_s: float = 600.0  # seconds one episode may take; past it the sample scores 0 (agent/timeouts)
    max_concurrency: int = 16  # episodes at once (threads of the driver)
    # how the model writes tool calls, parsed into the responses' tool_calls: hermes | llama3_json; None: never
    tool_call_format: Literal["hermes", "llama3_json"] | None = "hermes"
    host: str = "127.0.0.1"  # where the endpoint listens; 0.0.0.0 serves agents on other machines
    port: int = 0  # the endpoint's port; 0: any free one


@attrs.define
class MismatchGuardConfig:
    """Bounds on how far the generation engine's logprobs of its own samples may be from the
    trainer's for the same weights (the training metrics ``token_mult_prob_error``, the mean of
    ``exp(|trainer - engine|)`` per token, and ``mismatch_kl``, the k3 estimate of
    KL(engine || trainer) per token). Beyond a ``warn_`` bound a step logs a warning; beyond a
    ``stop_`` bound the run stops after the step, naming the likely causes. null: no bound.
    Float32 runs stay within 1e-5 of 1 and 1e-9; on-policy bf16 runs on GPUs typically
    1.01-1.03; asynchronous runs add the drift of their stale samples."""

    warn_token_mult_prob_error: float | None = 1.05  # > 1
    stop_token_mult_prob_error: float | None = 1.5  # > 1, >= the warn bound
    warn_mismatch_kl: float | None = 0.002  # > 0
    stop_mismatch_kl: float | None = 0.1  # > 0, >= the warn bound


#: The TIS bound asynchronous GRPO corrects with when ``grpo.loss`` names no correction.
ASYNC_IS_MAX = 2.0


@attrs.define
class AsynchronousConfig:
    """Asynchronous GRPO: generation runs ahead of training on its own workers, and a step
    trains on samples from weights up to ``max_staleness_steps`` versions old. Step s trains
    the weights of version s - 1 (the refit after step j carries version j; 0: the initial
    weights); a sample whose oldest token was generated by version v has staleness
    (s - 1) - v."""

    # k: the most versions a trained sample's weights may lag the trainer's; generation runs up to k
    # steps ahead. 0: synchronous GRPO (generate, then train). >= 1 needs generation.colocated=false
    max_staleness_steps: int = 0
    # true: a refit reaches the engines between two requests of the rollout in progress; false: it
    # waits until that step's rollout is finished, so each step's samples come from one version
    in_flight_weight_updates: bool = True
    # groups (prompts) generated ahead of the step being trained, at most: a multiple of
    # grpo.num_prompts_per_step, >= it when max_staleness_steps >= 1; None: all that the staleness bound allows
    max_groups_ahead: int | None = None
    # true: with max_staleness_steps >= 1 and grpo.loss.importance_sampling_correction null, correct with
    # TIS (weights exp(logp_trainer - logp_generation) truncated to [0, 2]); false: no correction unless
    # grpo.loss names one
    importance_sampling_correction: bool = True

    @property
    def enabled(self) -> bool:
        """Whether generation runs ahead of training (``max_staleness_steps`` >= 1)."""
        return self.max_staleness_steps >= 1

    def rounds_ahead(self, num_prompts_per_step: int) -> int:
        """Steps generation may run ahead of training: ``max_staleness_steps``, fewer when
        ``max_groups_ahead`` allows fewer rounds of ``num_prompts_per_step`` groups."""
        if self.max_groups_ahead is None:
            return self.max_staleness_steps
        return min(self.max_staleness_steps, self.max_groups_ahead // num_prompts_per_step)


@attrs.define
class GRPOConfig:
    """Group relative policy optimisation (and DAPO, GSPO, RLOO through the options). Its policy
    passes carry the experts of a mixture of experts that routing replay gives the routers
    (``policy.moe``: the rollouts' and the previous-logprob pass's)."""

    carries_routed_experts: ClassVar[bool] = True

    num_prompts_per_step: int = 32  # prompts per step (the data loader's batch), each rolled out as one group
    # responses per prompt, the group its baseline is computed over. The step's samples (this times
    # num_prompts_per_step) must be a multiple of policy.train_global_batch_size: one optimizer step each
    num_generations_per_prompt: int = 16
    max_num_steps: int = 1_000_000  # training steps at most; 0: validate only (with val_at_start), no training
    max_num_epochs: int = 1  # passes over the training prompts; the run ends when they are used up
    val_period: int = 0  # steps between validations (greedy rollouts of the validation prompts); 0: none in training
    val_at_start: bool = False  # validate before the first step (fresh runs, not resumed ones)
    max_val_samples: int | None = None  # validation prompts used per validation; None: all
    max_rollout_turns: int = 1  # assistant turns per sample at most; multi-turn environments need more than 1
    # leave_one_out: a sample's baseline is the mean reward of its group's other samples (needs
    # num_generations_per_prompt >= 2); mean: the group's mean reward; none: the reward itself is the advantage
    baseline: Baseline = "leave_one_out"
    # divide advantages by a reward std where it is > 0 (plus advantage_std_epsilon): the one of reward_std_scope
    normalize_rewards: bool = True
    # group: the std over the rewards the baseline is taken over (the group, or the leave-one-out others);
    # batch: the std of every reward of the rollout batch (TRL scale_rewards=batch)
    reward_std_scope: RewardStdScope = "group"
    advantage_std_epsilon: float = 1e-6  # added to the std before dividing (>= 0; TRL: 1e-4)
    # true: samples that train with sample_mask 0 (truncated ones under overlong_filtering) are left out of
    # their group's baseline and std and get advantage 0 (NeMo RL's valid mask); false: they count
    baseline_valid_only: bool = False
    # after the baseline and std: advantages shifted and scaled to mean 0 and std 1 over the rollout batch's
    # trained samples: samples (each sample counts once, unbiased std); tokens (each sample weighs its
    # loss tokens, biased std: Reinforce++); None: not
    whiten_advantages: AdvantageWhitening | None = None
    # sum: advantages of the summed reward; normalize_then_sum (GDPO): each named reward part the environments
    # report (EnvironmentReturn.reward_components; the overlong penalty is one more) gets its own baseline and
    # std, the parts' advantages are summed with reward_weights, and the sum whitened over the trained samples
    reward_aggregation: RewardAggregation = "sum"
    # normalize_then_sum: one weight per reward part, in the parts' alphabetical order (the overlong penalty,
    # "overlong", among them); None: all 1
    reward_weights: list[float] | None = None
    advantage_clip_low: float | None = None  # advantages clamped to [low, high]; None: no bound
    advantage_clip_high: float | None = None  # the upper bound of that clamp; None: no bound
    reward_scaling: RewardScalingConfig = attrs.field(factory=RewardScalingConfig)  # a linear map of rewards
    dynamic_sampling: DynamicSamplingConfig = attrs.field(factory=DynamicSamplingConfig)  # DAPO: groups with signal
    overlong_filtering: bool = False  # truncated responses stay in baselines but get no gradient
    # DAPO: a reward penalty for responses near the length limit
    overlong_reward_shaping: OverlongRewardShapingConfig = attrs.field(factory=OverlongRewardShapingConfig)
    # true: reference-policy logprobs only when loss.kl_penalty > 0; false: every step (the kl metric)
    skip_reference_logprobs_when_kl_off: bool = True
    # true: with one optimizer step per step's batch the policy that generated is the one that
    # trains, so prev_logprobs are the training pass's own logprobs (detached): no extra pass.
    # false: a logprob pass for prev_logprobs every step
    skip_prev_logprobs_when_on_policy: bool = True
    loss: ClippedPGConfig = attrs.field(factory=ClippedPGConfig)  # the clipped policy-gradient loss
    # warn or stop when the engine's logprobs of its samples are far from the trainer's
    mismatch_guard: MismatchGuardConfig = attrs.field(factory=MismatchGuardConfig)
    # asynchronous GRPO: generation ahead of training, within a staleness bound (off: synchronous)
    asynchronous: AsynchronousConfig = attrs.field(factory=AsynchronousConfig)
    agent: AgentConfig = attrs.field(factory=AgentConfig)  # rollouts by an outside agent instead of environments
    export_dir: str | None = None  # write a Hugging Face folder of the final weights here

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt

    def effective_loss(self, max_new_tokens: int | None = None, exact_rollouts: bool = False) -> ClippedPGConfig:
        """The loss options a run trains with: :attr:`loss`, with TIS to [0, ASYNC_IS_MAX]
        when the run is asynchronous, corrects off-policy samples, is not in bypass mode and
        the loss names no correction of its own; and with ``max_new_tokens`` (the generation
        budget) as the constant normaliser when ``token_normalizer`` is constant without one.

        ``exact_rollouts``: the rollouts' logprobs are the trainer's, bit for bit
        (``generation.exact_logprobs``). A synchronous run's samples come from the weights the
        step starts from, so the engine's logprobs are the previous policy's: the decoupled
        loss becomes ``rollout_correction: bypass`` (the same numbers, without the
        previous-logprob pass), its train/inference correction dropped (every weight is 1).
        Not with ``kl_in_reward``, whose estimate takes the previous policy's logprobs, which
        bypass replaces with the trained ones (the same only in a step's first update)."""
        loss, run_ahead = self.loss, self.asynchronous
        if (exact_rollouts and not run_ahead.enabled and loss.rollout_correction == "decoupled"
                and loss.kl_in_reward is None):
            loss = attrs.evolve(loss, rollout_correction="bypass", importance_sampling_correction=None,
                                is_min=None, is_max=None)
        if (run_ahead.enabled and run_ahead.importance_sampling_correction and loss.importance_sampling_correction is None
                and loss.rollout_correction == "decoupled"):
            loss = attrs.evolve(loss, importance_sampling_correction="tis", is_max=ASYNC_IS_MAX)
        if loss.token_normalizer == "constant" and loss.constant_normalizer is None and max_new_tokens is not None:
            loss = attrs.evolve(loss, constant_normalizer=max_new_tokens)
        return loss

    def cluster_demands(self, config: RunConfig) -> list[Demand]:
        """The policy's workers and the engines' (none for engines inside the policy's workers)."""
        return grpo_demands(config)

    def batch_size_rules(self) -> BatchSizeRules:
        """A step's samples make whole optimizer steps: core checks that
        ``policy.train_global_batch_size`` divides them, with its own batch rules."""
        return BatchSizeRules(
            global_divides=self.samples_per_step,
            global_reason=f"the samples of a GRPO step: grpo.num_prompts_per_step ({self.num_prompts_per_step}) x "
            f"grpo.num_generations_per_prompt ({self.num_generations_per_prompt})",
            keys=("grpo.num_prompts_per_step", "grpo.num_generations_per_prompt"),
        )


def grpo_demands(config: RunConfig) -> list[Demand]:
    """What a GRPO run holds of the Ray cluster (:mod:`posttrain.config.demands`): the
    policy's workers and the generation engines'."""
    return [d for d in (policy_demand(config.policy), generation_demand(config)) if d is not None]
