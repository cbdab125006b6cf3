"""Refuse GRPO configurations that cannot work, before any worker starts.

Every message names the key, what was found, and the fix. :func:`check_loss_config` also
runs when a :class:`~posttrain_grpo.loss.ClippedPGLoss` is built directly.
"""

from __future__ import annotations

from typing import get_args

from posttrain.config import RunConfig, require_registered, where_set
from posttrain.errors import ConfigError
from posttrain.plugins import PluginHost
from posttrain_grpo.config import (
    AdvantageWhitening,
    Baseline,
    ClippedPGConfig,
    GRPOConfig,
    ISCorrection,
    KLEstimator,
    KLImportanceWeight,
    KLInReward,
    NonfiniteGeneration,
    OverlongBeyondMax,
    PolicyLoss,
    RewardAggregation,
    RewardStdScope,
    RolloutCorrection,
    SequenceISWeight,
    TokenNormalizer,
)


def validate_run_config(config: RunConfig, host: PluginHost) -> None:
    """Check the ``grpo`` section of a run whose algorithm is ``grpo``; other runs pass."""
    if config.algorithm != "grpo":
        return
    grpo: GRPOConfig = config.section("grpo")
    check_loss_config(grpo.loss, "grpo.loss", config)
    check_grpo_config(grpo, config)
    require_registered(host.policy_backends, config.policy.backend, "policy.backend", config=config)
    require_registered(host.generation_backends, config.generation.backend, "generation.backend", config=config)


def check_loss_config(loss: ClippedPGConfig, key: str, config: RunConfig | None = None) -> None:
    """Raise :class:`ConfigError` for an invalid ``clipped_pg`` option set under ``key``
    (``config``, when given, tells where each key was set)."""
    for name, choices in (
        ("policy_loss", PolicyLoss),
        ("token_normalizer", TokenNormalizer),
        ("kl_estimator", KLEstimator),
        ("kl_importance_weight", KLImportanceWeight),
        ("kl_in_reward", KLInReward | None),
        ("importance_sampling_correction", ISCorrection | None),
        ("nonfinite_generation_logprobs", NonfiniteGeneration),
        ("sequence_is_weight", SequenceISWeight),
        ("rollout_correction", RolloutCorrection),
    ):
        _require_choice(getattr(loss, name), choices, f"{key}.{name}", config)
    for name in ("ratio_clip_low", "ratio_clip_high", "kl_penalty"):
        if getattr(loss, name) < 0:
            raise _error(config, f"{key}.{name}: must be >= 0, got {getattr(loss, name)}.", f"{key}.{name}")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if getattr(loss, name) <= 0:
            raise _error(config, f"{key}.{name}: must be > 0, got {getattr(loss, name)}.", f"{key}.{name}")
    for name in ("kl_input_clamp", "kl_output_clamp"):
        value = getattr(loss, name)
        if value is not None and value <= 0:
            raise _error(config, f"{key}.{name}: must be > 0 or null (no clamp), got {value}.", f"{key}.{name}")
    if loss.dual_clip_c is not None and loss.dual_clip_c <= 1:
        raise _error(
            config,
            f"{key}.dual_clip_c: must be > 1 (the bound c*|A| on negative-advantage losses), got "
            f"{loss.dual_clip_c}; use e.g. 3, or null to turn dual clipping off.",
            f"{key}.dual_clip_c",
        )
    if loss.sequence_level_ratio and loss.token_level_loss:
        raise _error(
            config,
            f"{key}.sequence_level_ratio: GSPO's sequence-level ratio needs sequence-level "
            f"normalisation, but {key}.token_level_loss is true; set {key}.token_level_loss=false.",
            f"{key}.sequence_level_ratio",
            f"{key}.token_level_loss",
        )
    if loss.disable_ppo_ratio and loss.sequence_level_ratio:
        raise _error(
            config,
            f"{key}.disable_ppo_ratio: REINFORCE (no ratio) cannot be combined with "
            f"{key}.sequence_level_ratio (GSPO's ratio); turn one of them off.",
            f"{key}.disable_ppo_ratio",
            f"{key}.sequence_level_ratio",
        )
    if loss.disable_ppo_ratio and loss.dual_clip_c is not None:
        raise _error(
            config,
            f"{key}.dual_clip_c: dual clipping bounds the PPO ratio, which "
            f"{key}.disable_ppo_ratio=true removes; set {key}.dual_clip_c=null.",
            f"{key}.dual_clip_c",
            f"{key}.disable_ppo_ratio",
        )
    _check_policy_loss(loss, key, config)
    _check_normalizer(loss, key, config)
    _check_kl(loss, key, config)
    _check_importance_sampling(loss, key, config)


def _check_policy_loss(loss: ClippedPGConfig, key: str, config: RunConfig | None) -> None:
    if loss.policy_loss == "ppo":
        return
    if loss.disable_ppo_ratio:
        raise _error(
            config,
            f"{key}.policy_loss: {loss.policy_loss} is built on the ratio r, which {key}.disable_ppo_ratio=true "
            f"removes; set {key}.policy_loss=ppo for REINFORCE, or disable_ppo_ratio=false.",
            f"{key}.policy_loss",
            f"{key}.disable_ppo_ratio",
        )
    if loss.dual_clip_c is not None:
        raise _error(
            config,
            f"{key}.dual_clip_c: dual clipping bounds the ppo objective, but {key}.policy_loss is "
            f"{loss.policy_loss}; set {key}.dual_clip_c=null.",
            f"{key}.dual_clip_c",
            f"{key}.policy_loss",
        )


def _check_normalizer(loss: ClippedPGConfig, key: str, config: RunConfig | None) -> None:
    if loss.token_normalizer != "global" and not loss.token_level_loss:
        raise _error(
            config,
            f"{key}.token_normalizer: {loss.token_normalizer} divides the summed token losses, but "
            f"{key}.token_level_loss is false (each sequence's mean, then the mean over sequences); set "
            f"{key}.token_level_loss=true or {key}.token_normalizer=global.",
            f"{key}.token_normalizer",
            f"{key}.token_level_loss",
        )
    if loss.constant_normalizer is not None:
        if loss.token_normalizer != "constant":
            raise _error(
                config,
                f"{key}.constant_normalizer is set but {key}.token_normalizer is {loss.token_normalizer}, so it "
                f"would be ignored; set {key}.token_normalizer=constant or remove {key}.constant_normalizer.",
                f"{key}.constant_normalizer",
                f"{key}.token_normalizer",
            )
        if loss.constant_normalizer < 1:
            raise _error(
                config,
                f"{key}.constant_normalizer: must be >= 1 (tokens per sequence), got {loss.constant_normalizer}.",
                f"{key}.constant_normalizer",
            )


def _check_kl(loss: ClippedPGConfig, key: str, config: RunConfig | None) -> None:
    if loss.kl_in_reward is not None and loss.kl_penalty == 0:
        raise _error(
            config,
            f"{key}.kl_in_reward: moves the KL penalty into the advantages, but {key}.kl_penalty is 0; set "
            f"{key}.kl_penalty > 0 (e.g. 0.01) or {key}.kl_in_reward=null.",
            f"{key}.kl_in_reward",
            f"{key}.kl_penalty",
        )
    if loss.kl_importance_weight != "on_policy" and (loss.kl_penalty == 0 or loss.kl_in_reward is not None):
        where = "is 0" if loss.kl_penalty == 0 else f"is in the advantages ({key}.kl_in_reward={loss.kl_in_reward})"
        raise _error(
            config,
            f"{key}.kl_importance_weight: weighs the KL term of the loss, but the penalty ({key}.kl_penalty) "
            f"{where}, so it would be ignored; remove {key}.kl_importance_weight.",
            f"{key}.kl_importance_weight",
            f"{key}.kl_penalty",
            f"{key}.kl_in_reward",
        )


def _check_importance_sampling(loss: ClippedPGConfig, key: str, config: RunConfig | None) -> None:
    kind = loss.importance_sampling_correction
    kind_key = f"{key}.importance_sampling_correction"
    if loss.sequence_is_weight != "geometric_mean" and not loss.sequence_level_ratio:
        raise _error(
            config,
            f"{key}.sequence_is_weight: sets the weight of GSPO's sequences, but {key}.sequence_level_ratio is false; "
            f"set {key}.sequence_level_ratio=true, or for product weights with token ratios "
            f"{kind_key}=sequence_truncate or sequence_mask.",
            f"{key}.sequence_is_weight",
            f"{key}.sequence_level_ratio",
        )
    if kind in ("sequence_truncate", "sequence_mask") and loss.sequence_level_ratio:
        raise _error(
            config,
            f"{kind_key}: {kind} weighs each sequence by its product of token weights, and with "
            f"{key}.sequence_level_ratio (GSPO) tis and icepop already weigh whole sequences; use "
            f"{kind_key}={'tis' if kind == 'sequence_truncate' else 'icepop'} with {key}.sequence_is_weight=product, "
            "which means the same.",
            kind_key,
            f"{key}.sequence_level_ratio",
        )
    if kind is not None and loss.rollout_correction == "bypass":
        raise _error(
            config,
            f"{kind_key}: with {key}.rollout_correction=bypass the ratio is taken against the generation engine's "
            f"logprobs, so the weights exp(prev - generation) would all be 1; set {kind_key}=null, or "
            f"{key}.rollout_correction=decoupled.",
            kind_key,
            f"{key}.rollout_correction",
        )
    if kind is None:
        for name in ("is_min", "is_max"):
            if getattr(loss, name) is not None:
                raise _error(
                    config,
                    f"{key}.{name} is set but {kind_key} is null, so it would be ignored; set "
                    f"{kind_key} to one of {', '.join(get_args(ISCorrection))}, or remove {key}.{name}.",
                    f"{key}.{name}",
                )
        return
    required = ("is_min", "is_max") if kind in ("icepop", "seq_mask_tis") else ("is_max",)
    for name in required:
        if getattr(loss, name) is None:
            raise _error(
                config,
                f"{key}.{name}: importance_sampling_correction={kind} needs bounds "
                f"{' and '.join(required)}; {name} is missing (e.g. is_min=0.5, is_max=2.0).",
                kind_key,
            )
    if loss.is_min is not None and loss.is_min < 0:
        raise _error(
            config,
            f"{key}.is_min: importance weights are positive; must be >= 0, got {loss.is_min}.",
            f"{key}.is_min",
        )
    if loss.is_max is not None and loss.is_max <= 0:
        raise _error(config, f"{key}.is_max: must be > 0, got {loss.is_max}.", f"{key}.is_max")
    if loss.is_min is not None and loss.is_max is not None and loss.is_min > loss.is_max:
        raise _error(
            config,
            f"{key}.is_min: {loss.is_min} is greater than {key}.is_max={loss.is_max}; swap them.",
            f"{key}.is_min",
            f"{key}.is_max",
        )


def check_grpo_config(grpo: GRPOConfig, config: RunConfig) -> None:
    """Raise :class:`ConfigError` for an invalid ``grpo`` section (loss options aside), or one
    that runs no previous-logprob pass for ``policy.moe.routing_replay: previous`` to replay."""
    if config.policy.moe.routing_replay == "previous" and grpo.loss.rollout_correction == "bypass":
        raise _error(
            config,
            "policy.moe.routing_replay: previous replays the experts of the previous-logprob pass, which "
            "grpo.loss.rollout_correction: bypass does not run (the engine's logprobs are the previous policy's). "
            "Set grpo.loss.rollout_correction: decoupled, or policy.moe.routing_replay: rollout with an engine that "
            "records the experts (hf).",
            "policy.moe.routing_replay", "grpo.loss.rollout_correction",
        )
    for name in (
        "num_prompts_per_step",
        "num_generations_per_prompt",
        "max_num_epochs",
        "max_rollout_turns",
    ):
        if getattr(grpo, name) < 1:
            if name == "num_generations_per_prompt" and grpo.baseline == "leave_one_out":
                raise _error(config, f"grpo.{name}: must be >= 2 with grpo.baseline: leave_one_out (the baseline is the "
                             f"mean of the other samples of the prompt), got {grpo.num_generations_per_prompt}.",
                             f"grpo.{name}", "grpo.baseline")
            raise _error(config, f"grpo.{name}: must be >= 1, got {getattr(grpo, name)}.", f"grpo.{name}")
    if grpo.max_num_steps < 0:
        raise _error(config, f"grpo.max_num_steps: must be >= 0 (0 validates only), got {grpo.max_num_steps}.", "grpo.max_num_steps")
    if grpo.val_period < 0:
        raise _error(
            config,
            f"grpo.val_period: must be >= 0 (0 turns validation off), got {grpo.val_period}.",
            "grpo.val_period",
        )
    if grpo.max_val_samples is not None and grpo.max_val_samples < 1:
        raise _error(
            config,
            f"grpo.max_val_samples: must be >= 1, or null for the whole validation set, got {grpo.max_val_samples}.",
            "grpo.max_val_samples",
        )
    _require_choice(grpo.baseline, Baseline, "grpo.baseline", config)
    _check_advantages(grpo, config)
    _check_mismatch_guard(grpo, config)
    n = grpo.num_generations_per_prompt
    if grpo.baseline == "leave_one_out" and n < 2:
        raise _error(
            config,
            f"grpo.baseline: leave_one_out needs grpo.num_generations_per_prompt >= 2 (the baseline "
            f"is the mean of the other samples of the prompt), got {n}.",
            "grpo.baseline",
            "grpo.num_generations_per_prompt",
        )
    low, high = grpo.advantage_clip_low, grpo.advantage_clip_high
    if low is not None and high is not None and low > high:
        raise _error(
            config,
            f"grpo.advantage_clip_low: {low} is greater than grpo.advantage_clip_high={high}.",
            "grpo.advantage_clip_low",
            "grpo.advantage_clip_high",
        )
    scaling = grpo.reward_scaling
    if scaling.enabled and scaling.source_max <= scaling.source_min:
        raise _error(
            config,
            f"grpo.reward_scaling.source_max: must be greater than source_min, got "
            f"source_min={scaling.source_min}, source_max={scaling.source_max}.",
            "grpo.reward_scaling.source_min",
            "grpo.reward_scaling.source_max",
        )
    _check_dynamic_sampling(grpo, config)
    _check_overlong_shaping(grpo, config)
    _check_asynchronous(grpo, config)
    _check_agent(grpo, config)
    gbs = config.policy.train_global_batch_size
    if gbs < 1 or grpo.samples_per_step % gbs:
        raise _error(
            config,
            f"policy.train_global_batch_size: grpo.num_prompts_per_step * grpo.num_generations_per_prompt "
            f"= {grpo.num_prompts_per_step} * {n} = {grpo.samples_per_step} samples per step is not a "
            f"multiple of policy.train_global_batch_size = {gbs}; choose a train_global_batch_size that "
            f"divides {grpo.samples_per_step}, or change num_prompts_per_step.",
            "grpo.num_prompts_per_step",
            "grpo.num_generations_per_prompt",
            "policy.train_global_batch_size",
        )


def _check_advantages(grpo: GRPOConfig, config: RunConfig) -> None:
    _require_choice(grpo.reward_std_scope, RewardStdScope, "grpo.reward_std_scope", config)
    _require_choice(grpo.whiten_advantages, AdvantageWhitening | None, "grpo.whiten_advantages", config)
    if grpo.advantage_std_epsilon < 0:
        raise _error(
            config, f"grpo.advantage_std_epsilon: must be >= 0, got {grpo.advantage_std_epsilon}.",
            "grpo.advantage_std_epsilon",
        )
    if grpo.baseline == "none" and grpo.normalize_rewards:
        raise _error(
            config,
            "grpo.normalize_rewards: divides the reward's deviation from its baseline by a reward std, but "
            "grpo.baseline is none (the raw reward is the advantage); set grpo.normalize_rewards=false, and "
            "grpo.whiten_advantages=samples or tokens to standardise raw rewards over the batch.",
            "grpo.normalize_rewards",
            "grpo.baseline",
        )
    _require_choice(grpo.reward_aggregation, RewardAggregation, "grpo.reward_aggregation", config)
    if grpo.reward_aggregation == "normalize_then_sum" and grpo.whiten_advantages is not None:
        raise _error(
            config,
            f"grpo.whiten_advantages: reward_aggregation=normalize_then_sum whitens the summed advantages over the "
            f"samples itself, so whiten_advantages={grpo.whiten_advantages} would be a second whitening; remove "
            "grpo.whiten_advantages.",
            "grpo.whiten_advantages",
            "grpo.reward_aggregation",
        )
    if grpo.reward_weights is not None and grpo.reward_aggregation != "normalize_then_sum":
        raise _error(
            config,
            "grpo.reward_weights is set but grpo.reward_aggregation is sum (the environments' summed reward), so it "
            "would be ignored; set grpo.reward_aggregation=normalize_then_sum or remove grpo.reward_weights.",
            "grpo.reward_weights",
            "grpo.reward_aggregation",
        )
    if grpo.reward_std_scope != "group" and not grpo.normalize_rewards:
        raise _error(
            config,
            f"grpo.reward_std_scope is {grpo.reward_std_scope} but grpo.normalize_rewards is false, so it would be "
            "ignored; set grpo.normalize_rewards=true or remove grpo.reward_std_scope.",
            "grpo.reward_std_scope",
            "grpo.normalize_rewards",
        )


def _check_dynamic_sampling(grpo: GRPOConfig, config: RunConfig) -> None:
    sampling = grpo.dynamic_sampling
    if not sampling.enabled:
        return
    if sampling.max_gen_batches < 1:
        raise _error(
            config,
            f"grpo.dynamic_sampling.max_gen_batches: must be >= 1, got {sampling.max_gen_batches}.",
            "grpo.dynamic_sampling.max_gen_batches",
        )
    if grpo.num_generations_per_prompt < 2:
        raise _error(
            config,
            f"grpo.dynamic_sampling.enabled: keeps only prompts whose generations got different "
            f"rewards, which needs grpo.num_generations_per_prompt >= 2, got {grpo.num_generations_per_prompt}.",
            "grpo.dynamic_sampling.enabled",
            "grpo.num_generations_per_prompt",
        )


def _check_overlong_shaping(grpo: GRPOConfig, config: RunConfig) -> None:
    shaping = grpo.overlong_reward_shaping
    if not shaping.enabled:
        return
    key = "grpo.overlong_reward_shaping"
    _require_choice(shaping.beyond_max, OverlongBeyondMax, f"{key}.beyond_max", config)
    if shaping.penalty < 0:
        raise _error(
            config,
            f"{key}.penalty: must be >= 0 (the largest reward deduction), got {shaping.penalty}.",
            f"{key}.penalty",
        )
    max_len = shaping.max_response_length
    if max_len is None:
        max_len = config.generation.max_new_tokens
    if not 1 <= shaping.buffer_length <= max_len:
        raise _error(
            config,
            f"{key}.buffer_length: must be between 1 and the maximum response length {max_len} "
            f"({key}.max_response_length, or generation.max_new_tokens when unset), got "
            f"{shaping.buffer_length}.",
            f"{key}.buffer_length",
            f"{key}.max_response_length",
            "generation.max_new_tokens",
        )


def _check_asynchronous(grpo: GRPOConfig, config: RunConfig) -> None:
    run_ahead, key = grpo.asynchronous, "grpo.asynchronous"
    k = run_ahead.max_staleness_steps
    if k < 0:
        raise _error(
            config,
            f"{key}.max_staleness_steps: must be >= 0 (0: synchronous GRPO; k >= 1: samples up to k weight versions "
            f"old train), got {k}.",
            f"{key}.max_staleness_steps",
        )
    if k >= 1 and config.generation.colocated:
        inside = config.generation.in_policy_workers is True  # which needs colocated: both must change
        change = ("generation.colocated=false and generation.in_policy_workers=false" if inside
                  else "generation.colocated=false")
        raise _error(
            config,
            f"{key}.max_staleness_steps={k} generates while the policy trains, which a colocated engine cannot do: it "
            f"shares the policy's devices and takes turns with it. Set {change} (the engines then "
            "run on resources of their own, generation.resources), or max_staleness_steps=0 for synchronous GRPO.",
            f"{key}.max_staleness_steps",
            "generation.colocated",
            *(["generation.in_policy_workers"] if inside else []),
        )
    ahead = run_ahead.max_groups_ahead
    if ahead is None:
        return
    prompts = grpo.num_prompts_per_step
    if k == 0:
        raise _error(
            config,
            f"{key}.max_groups_ahead is set but {key}.max_staleness_steps is 0 (synchronous GRPO generates nothing "
            f"ahead), so it would be ignored; set max_staleness_steps >= 1 or remove max_groups_ahead.",
            f"{key}.max_groups_ahead",
        )
    if ahead < prompts or ahead % prompts:
        raise _error(
            config,
            f"{key}.max_groups_ahead: generation runs ahead by whole steps of grpo.num_prompts_per_step={prompts} "
            f"groups, so it must be a multiple of {prompts} (at least one step), got {ahead}.",
            f"{key}.max_groups_ahead",
            "grpo.num_prompts_per_step",
        )


def _check_agent(grpo: GRPOConfig, config: RunConfig) -> None:
    agent = grpo.agent
    if agent.entry is None:
        return
    for name in ("timeout_s", "max_concurrency"):
        if getattr(agent, name) <= 0:
            raise _error(config, f"grpo.agent.{name}: must be > 0, got {getattr(agent, name)}.", f"grpo.agent.{name}")
    if not 0 <= agent.port < 65536:
        raise _error(config, f"grpo.agent.port: must be 0 (any free port) to 65535, got {agent.port}.", "grpo.agent.port")


def _require_choice(value: object, choices: object, key: str, config: RunConfig | None) -> None:
    """``choices``: a ``Literal``, or ``Literal | None`` (then null is allowed too)."""
    options = get_args(choices)
    if type(None) in options:
        if value is None:
            return
        options = tuple(option for option in options if option is not type(None))
    allowed = tuple(name for option in options for name in (get_args(option) or (option,)))
    if value not in allowed:
        raise _error(config, f"{key}: expected one of {', '.join(allowed)}, got {value!r}.", key)


def _error(config: RunConfig | None, message: str, *keys: str) -> ConfigError:
    """``message`` plus where the named keys were set (when the loader recorded it)."""
    return ConfigError(message + where_set(config, *keys))


def _check_mismatch_guard(grpo: GRPOConfig, config: RunConfig) -> None:
    """Each bound above its metric's on-policy value (1 for the error, 0 for the KL), and a
    warn bound at most its stop bound."""
    guard = grpo.mismatch_guard
    for metric, floor in (("token_mult_prob_error", 1.0), ("mismatch_kl", 0.0)):
        warn, stop = getattr(guard, f"warn_{metric}"), getattr(guard, f"stop_{metric}")
        for kind, value in (("warn", warn), ("stop", stop)):
            if value is not None and value <= floor:
                key = f"grpo.mismatch_guard.{kind}_{metric}"
                raise _error(
                    config,
                    f"{key}: must be > {floor:g} ({metric} is {floor:g} when the engine and the trainer agree) "
                    f"or null (no bound), got {value}.",
                    key,
                )
        if warn is not None and stop is not None and warn > stop:
            raise _error(
                config,
                f"grpo.mismatch_guard.warn_{metric}: {warn} is greater than grpo.mismatch_guard.stop_{metric}={stop}; "
                "a run would stop before it warned. Lower the warn bound or raise the stop bound.",
                f"grpo.mismatch_guard.warn_{metric}",
                f"grpo.mismatch_guard.stop_{metric}",
            )
