"""The grpo section and clipped_pg loss are registered, and invalid combinations are refused
through the real plugin host with a message naming the key and the fix."""

from __future__ import annotations

import attrs
import pytest

from posttrain import hookimpl
from posttrain.config import GenerationConfig, PolicyConfig, RunConfig, load_config
from posttrain.errors import ConfigError
from posttrain.plugins import new_plugin_host, set_plugin_host
from posttrain_grpo.config import (
    AgentConfig,
    AsynchronousConfig,
    ClippedPGConfig,
    DynamicSamplingConfig,
    GRPOConfig,
    MismatchGuardConfig,
    OverlongRewardShapingConfig,
    RewardScalingConfig,
)
from posttrain_grpo.loss import ClippedPGLoss


class BackendNames:
    """Registers backend names so validation can find them (the factories are never called)."""

    @hookimpl
    def posttrain_policy_backends(self):
        return {"grpo-test-policy": object}

    @hookimpl
    def posttrain_generation_backends(self):
        return {"grpo-test-generation": object}


@pytest.fixture
def host():
    host = new_plugin_host()  # loads every installed plugin, posttrain-grpo among them
    host.register(BackendNames(), name="grpo-test-backends")
    set_plugin_host(host)
    yield host
    set_plugin_host(None)


def run_config(grpo: GRPOConfig | None = None, **policy) -> RunConfig:
    return RunConfig(
        algorithm="grpo",
        policy=PolicyConfig(backend="grpo-test-policy", **{"train_global_batch_size": 16, **policy}),
        generation=GenerationConfig(backend="grpo-test-generation", max_new_tokens=64),
        sections={"grpo": grpo or GRPOConfig(num_prompts_per_step=4, num_generations_per_prompt=8)},
    )


def validate(host, config: RunConfig) -> None:
    host.hook.posttrain_validate_config(config=config)


def test_registrations(host):
    assert host.config_sections["grpo"] is GRPOConfig
    assert host.losses.distribution_of("clipped_pg").startswith("posttrain-grpo ")
    loss = host.losses["clipped_pg"](ClippedPGConfig(kl_penalty=0.01))
    assert isinstance(loss, ClippedPGLoss) and loss.config.kl_penalty == 0.01


def test_valid_config_passes(host):
    validate(host, run_config())
    validate(
        host,
        run_config(
            GRPOConfig(
                num_prompts_per_step=4,
                num_generations_per_prompt=8,
                loss=ClippedPGConfig(
                    token_level_loss=False,
                    sequence_level_ratio=True,
                    importance_sampling_correction="seq_mask_tis",
                    is_min=0.99,
                    is_max=1.01,
                ),
            )
        ),
    )


def test_other_algorithms_are_not_checked(host):
    config = run_config(GRPOConfig(baseline="median"))
    validate(host, attrs.evolve(config, algorithm="sft"))


def loss(**options) -> GRPOConfig:
    return GRPOConfig(num_prompts_per_step=4, num_generations_per_prompt=8, loss=ClippedPGConfig(**options))


def grpo(**options) -> GRPOConfig:
    return GRPOConfig(**{"num_prompts_per_step": 4, "num_generations_per_prompt": 8, **options})


INVALID = {
    "gspo_token_level": (
        loss(sequence_level_ratio=True),
        "grpo.loss.sequence_level_ratio: GSPO's sequence-level ratio needs sequence-level normalisation, but "
        "grpo.loss.token_level_loss is true; set grpo.loss.token_level_loss=false.",
    ),
    "reinforce_gspo": (
        loss(disable_ppo_ratio=True, sequence_level_ratio=True, token_level_loss=False),
        "grpo.loss.disable_ppo_ratio: REINFORCE (no ratio) cannot be combined with grpo.loss.sequence_level_ratio",
    ),
    "reinforce_dual_clip": (loss(disable_ppo_ratio=True, dual_clip_c=3.0), "set grpo.loss.dual_clip_c=null"),
    "dual_clip_le_1": (
        loss(dual_clip_c=1.0),
        "grpo.loss.dual_clip_c: must be > 1 (the bound c*|A| on negative-advantage losses), got 1.0",
    ),
    "negative_clip_low": (loss(ratio_clip_low=-0.1), "grpo.loss.ratio_clip_low: must be >= 0, got -0.1."),
    "negative_clip_high": (loss(ratio_clip_high=-0.2), "grpo.loss.ratio_clip_high: must be >= 0, got -0.2."),
    "negative_kl": (loss(kl_penalty=-0.01), "grpo.loss.kl_penalty: must be >= 0, got -0.01."),
    "kl_clamp_zero": (loss(kl_input_clamp=0.0), "grpo.loss.kl_input_clamp: must be > 0 or null (no clamp), got 0.0."),
    "bad_estimator": (loss(kl_estimator="k4"), "grpo.loss.kl_estimator: expected one of k1, k2, k3, got 'k4'."),
    "bad_is_kind": (
        loss(importance_sampling_correction="tiss", is_max=2.0),
        "grpo.loss.importance_sampling_correction: expected one of tis, icepop, seq_mask_tis, sequence_truncate, "
        "sequence_mask, got 'tiss'.",
    ),
    "tis_without_max": (
        loss(importance_sampling_correction="tis", is_min=0.5),
        "grpo.loss.is_max: importance_sampling_correction=tis needs bounds is_max; is_max is missing",
    ),
    "icepop_without_min": (
        loss(importance_sampling_correction="icepop", is_max=2.0),
        "grpo.loss.is_min: importance_sampling_correction=icepop needs bounds is_min and is_max; is_min is missing",
    ),
    "seq_mask_without_max": (
        loss(importance_sampling_correction="seq_mask_tis", is_min=0.99),
        "grpo.loss.is_max: importance_sampling_correction=seq_mask_tis needs bounds is_min and is_max",
    ),
    "is_min_gt_max": (
        loss(importance_sampling_correction="icepop", is_min=2.0, is_max=0.5),
        "grpo.loss.is_min: 2.0 is greater than grpo.loss.is_max=0.5; swap them.",
    ),
    "negative_is_min": (
        loss(importance_sampling_correction="tis", is_min=-1.0, is_max=2.0),
        "grpo.loss.is_min: importance weights are positive",
    ),
    "bounds_without_correction": (
        loss(is_max=2.0),
        "grpo.loss.is_max is set but grpo.loss.importance_sampling_correction is null",
    ),
    "sequence_mode_with_gspo": (
        loss(token_level_loss=False, sequence_level_ratio=True, importance_sampling_correction="sequence_mask",
             is_max=3.0),
        "grpo.loss.importance_sampling_correction: sequence_mask weighs each sequence by its product of token "
        "weights, and with grpo.loss.sequence_level_ratio (GSPO) tis and icepop already weigh whole sequences; use "
        "grpo.loss.importance_sampling_correction=icepop with grpo.loss.sequence_is_weight=product, which means the "
        "same.",
    ),
    "product_weight_with_token_ratios": (
        loss(sequence_is_weight="product", importance_sampling_correction="tis", is_max=2.0),
        "grpo.loss.sequence_is_weight: sets the weight of GSPO's sequences, but grpo.loss.sequence_level_ratio is "
        "false; set grpo.loss.sequence_level_ratio=true, or for product weights with token ratios "
        "grpo.loss.importance_sampling_correction=sequence_truncate or sequence_mask.",
    ),
    "sequence_truncate_without_max": (
        loss(importance_sampling_correction="sequence_truncate", is_min=0.5),
        "grpo.loss.is_max: importance_sampling_correction=sequence_truncate needs bounds is_max; is_max is missing",
    ),
    "bypass_with_correction": (
        loss(rollout_correction="bypass", importance_sampling_correction="tis", is_max=2.0),
        "grpo.loss.importance_sampling_correction: with grpo.loss.rollout_correction=bypass the ratio is taken "
        "against the generation engine's logprobs, so the weights exp(prev - generation) would all be 1; set "
        "grpo.loss.importance_sampling_correction=null, or grpo.loss.rollout_correction=decoupled.",
    ),
    "cispo_without_ratio": (
        loss(policy_loss="cispo", disable_ppo_ratio=True),
        "grpo.loss.policy_loss: cispo is built on the ratio r, which grpo.loss.disable_ppo_ratio=true removes; set "
        "grpo.loss.policy_loss=ppo for REINFORCE, or disable_ppo_ratio=false.",
    ),
    "sapo_dual_clip": (
        loss(policy_loss="sapo", dual_clip_c=3.0),
        "grpo.loss.dual_clip_c: dual clipping bounds the ppo objective, but grpo.loss.policy_loss is sapo; set "
        "grpo.loss.dual_clip_c=null.",
    ),
    "sapo_temperature": (loss(policy_loss="sapo", sapo_temperature_neg=0.0),
                         "grpo.loss.sapo_temperature_neg: must be > 0, got 0.0."),
    "bad_policy_loss": (loss(policy_loss="grpo"), "grpo.loss.policy_loss: expected one of ppo, cispo, sapo, got 'grpo'."),
    "normalizer_with_sequence_loss": (
        loss(token_level_loss=False, token_normalizer="constant"),
        "grpo.loss.token_normalizer: constant divides the summed token losses, but grpo.loss.token_level_loss is "
        "false (each sequence's mean, then the mean over sequences); set grpo.loss.token_level_loss=true or "
        "grpo.loss.token_normalizer=global.",
    ),
    "constant_without_constant_normalizer": (
        loss(constant_normalizer=512),
        "grpo.loss.constant_normalizer is set but grpo.loss.token_normalizer is global, so it would be ignored; set "
        "grpo.loss.token_normalizer=constant or remove grpo.loss.constant_normalizer.",
    ),
    "constant_normalizer_zero": (
        loss(token_normalizer="constant", constant_normalizer=0),
        "grpo.loss.constant_normalizer: must be >= 1 (tokens per sequence), got 0.",
    ),
    "kl_in_reward_without_penalty": (
        loss(kl_in_reward="token"),
        "grpo.loss.kl_in_reward: moves the KL penalty into the advantages, but grpo.loss.kl_penalty is 0; set "
        "grpo.loss.kl_penalty > 0 (e.g. 0.01) or grpo.loss.kl_in_reward=null.",
    ),
    "kl_weight_without_penalty": (
        loss(kl_importance_weight="none"),
        "grpo.loss.kl_importance_weight: weighs the KL term of the loss, but the penalty (grpo.loss.kl_penalty) is "
        "0, so it would be ignored; remove grpo.loss.kl_importance_weight.",
    ),
    "kl_weight_with_kl_in_reward": (
        loss(kl_penalty=0.1, kl_in_reward="return_to_go", kl_importance_weight="generation"),
        "grpo.loss.kl_importance_weight: weighs the KL term of the loss, but the penalty (grpo.loss.kl_penalty) is "
        "in the advantages (grpo.loss.kl_in_reward=return_to_go), so it would be ignored",
    ),
    "bad_kl_in_reward": (loss(kl_penalty=0.1, kl_in_reward="sequence"),
                         "grpo.loss.kl_in_reward: expected one of token, return_to_go, got 'sequence'."),
    "bad_nonfinite_handling": (
        loss(nonfinite_generation_logprobs="zero"),
        "grpo.loss.nonfinite_generation_logprobs: expected one of drop_sequence, drop_token, neutral_token, got 'zero'.",
    ),
    "raw_rewards_normalised": (
        grpo(baseline="none"),
        "grpo.normalize_rewards: divides the reward's deviation from its baseline by a reward std, but grpo.baseline "
        "is none (the raw reward is the advantage); set grpo.normalize_rewards=false, and grpo.whiten_advantages="
        "samples or tokens to standardise raw rewards over the batch.",
    ),
    "batch_std_without_normalising": (
        grpo(normalize_rewards=False, reward_std_scope="batch"),
        "grpo.reward_std_scope is batch but grpo.normalize_rewards is false, so it would be ignored; set "
        "grpo.normalize_rewards=true or remove grpo.reward_std_scope.",
    ),
    "negative_std_epsilon": (grpo(advantage_std_epsilon=-1e-4), "grpo.advantage_std_epsilon: must be >= 0, got -0.0001."),
    "bad_whitening": (grpo(whiten_advantages="global"),
                      "grpo.whiten_advantages: expected one of samples, tokens, got 'global'."),
    "bad_overlong_beyond_max": (
        grpo(overlong_reward_shaping=OverlongRewardShapingConfig(enabled=True, buffer_length=16, beyond_max="linearly")),
        "grpo.overlong_reward_shaping.beyond_max: expected one of capped, linear, got 'linearly'.",
    ),
    "gdpo_whitened_twice": (
        grpo(reward_aggregation="normalize_then_sum", whiten_advantages="tokens"),
        "grpo.whiten_advantages: reward_aggregation=normalize_then_sum whitens the summed advantages over the samples "
        "itself, so whiten_advantages=tokens would be a second whitening; remove grpo.whiten_advantages.",
    ),
    "reward_weights_without_gdpo": (
        grpo(reward_weights=[1.0, 2.0]),
        "grpo.reward_weights is set but grpo.reward_aggregation is sum (the environments' summed reward), so it would "
        "be ignored; set grpo.reward_aggregation=normalize_then_sum or remove grpo.reward_weights.",
    ),
    "loo_single_generation": (
        GRPOConfig(num_prompts_per_step=16, num_generations_per_prompt=1),
        "grpo.baseline: leave_one_out needs grpo.num_generations_per_prompt >= 2 (the baseline is the mean of the "
        "other samples of the prompt), got 1.",
    ),
    "bad_baseline": (grpo(baseline="median"), "grpo.baseline: expected one of mean, leave_one_out, none, got 'median'."),
    "zero_prompts": (grpo(num_prompts_per_step=0), "grpo.num_prompts_per_step: must be >= 1, got 0."),
    "negative_val_period": (grpo(val_period=-1), "grpo.val_period: must be >= 0"),
    "advantage_clip_order": (
        grpo(advantage_clip_low=1.0, advantage_clip_high=-1.0),
        "grpo.advantage_clip_low: 1.0 is greater than grpo.advantage_clip_high=-1.0.",
    ),
    "reward_scaling_range": (
        grpo(reward_scaling=RewardScalingConfig(enabled=True, source_min=1.0, source_max=1.0)),
        "grpo.reward_scaling.source_max: must be greater than source_min, got source_min=1.0, source_max=1.0.",
    ),
    "dynamic_sampling_single_generation": (
        GRPOConfig(
            num_prompts_per_step=16,
            num_generations_per_prompt=1,
            baseline="mean",
            dynamic_sampling=DynamicSamplingConfig(enabled=True),
        ),
        "grpo.dynamic_sampling.enabled: keeps only prompts whose generations got different rewards, which needs "
        "grpo.num_generations_per_prompt >= 2, got 1.",
    ),
    "dynamic_sampling_zero_batches": (
        grpo(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_gen_batches=0)),
        "grpo.dynamic_sampling.max_gen_batches: must be >= 1, got 0.",
    ),
    "overlong_buffer_too_long": (
        grpo(overlong_reward_shaping=OverlongRewardShapingConfig(enabled=True, buffer_length=100)),
        "grpo.overlong_reward_shaping.buffer_length: must be between 1 and the maximum response length 64 "
        "(grpo.overlong_reward_shaping.max_response_length, or generation.max_new_tokens when unset), got 100.",
    ),
    "overlong_negative_penalty": (
        grpo(overlong_reward_shaping=OverlongRewardShapingConfig(enabled=True, buffer_length=16, penalty=-1.0)),
        "grpo.overlong_reward_shaping.penalty: must be >= 0",
    ),
    "async_negative_staleness": (
        grpo(asynchronous=AsynchronousConfig(max_staleness_steps=-1)),
        "grpo.asynchronous.max_staleness_steps: must be >= 0 (0: synchronous GRPO; k >= 1: samples up to k weight "
        "versions old train), got -1.",
    ),
    "async_with_a_colocated_engine": (
        grpo(asynchronous=AsynchronousConfig(max_staleness_steps=1)),
        "grpo.asynchronous.max_staleness_steps=1 generates while the policy trains, which a colocated engine cannot "
        "do: it shares the policy's devices and takes turns with it. Set generation.colocated=false (the engines then "
        "run on resources of their own, generation.resources), or max_staleness_steps=0 for synchronous GRPO.",
    ),
    "mismatch_error_bound_at_one": (
        grpo(mismatch_guard=MismatchGuardConfig(stop_token_mult_prob_error=1.0)),
        "grpo.mismatch_guard.stop_token_mult_prob_error: must be > 1 (token_mult_prob_error is 1 when the engine and "
        "the trainer agree) or null (no bound), got 1.0.",
    ),
    "mismatch_kl_negative": (
        grpo(mismatch_guard=MismatchGuardConfig(warn_mismatch_kl=-0.1)),
        "grpo.mismatch_guard.warn_mismatch_kl: must be > 0 (mismatch_kl is 0 when the engine and the trainer agree) "
        "or null (no bound), got -0.1.",
    ),
    "mismatch_warn_above_stop": (
        grpo(mismatch_guard=MismatchGuardConfig(warn_token_mult_prob_error=2.0, stop_token_mult_prob_error=1.5)),
        "grpo.mismatch_guard.warn_token_mult_prob_error: 2.0 is greater than "
        "grpo.mismatch_guard.stop_token_mult_prob_error=1.5; a run would stop before it warned.",
    ),
    "groups_ahead_when_synchronous": (
        grpo(asynchronous=AsynchronousConfig(max_groups_ahead=8)),
        "grpo.asynchronous.max_groups_ahead is set but grpo.asynchronous.max_staleness_steps is 0",
    ),
    "agent_without_time": (
        grpo(agent=AgentConfig(entry="tests.e2e.openai_agent:solve", timeout_s=0)),
        "grpo.agent.timeout_s: must be > 0, got 0.",
    ),
    "agent_port": (
        grpo(agent=AgentConfig(entry="tests.e2e.openai_agent:solve", port=70000)),
        "grpo.agent.port: must be 0 (any free port) to 65535, got 70000.",
    ),
    "batch_arithmetic": (
        GRPOConfig(num_prompts_per_step=3, num_generations_per_prompt=4),
        "policy.train_global_batch_size: grpo.num_prompts_per_step * grpo.num_generations_per_prompt = 3 * 4 = 12 "
        "samples per step is not a multiple of policy.train_global_batch_size = 16; choose a "
        "train_global_batch_size that divides 12, or change num_prompts_per_step.",
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_combination_refused(host, name):
    config, message = INVALID[name]
    with pytest.raises(ConfigError) as info:
        validate(host, run_config(config))
    assert message in str(info.value)


@pytest.mark.parametrize("ahead", [2, 6])
def test_generation_runs_ahead_by_whole_steps(host, ahead):
    config = run_config(grpo(asynchronous=AsynchronousConfig(max_staleness_steps=2, max_groups_ahead=ahead)))
    config = attrs.evolve(config, generation=attrs.evolve(config.generation, colocated=False))
    with pytest.raises(ConfigError) as info:
        validate(host, config)
    assert str(info.value) == (
        "grpo.asynchronous.max_groups_ahead: generation runs ahead by whole steps of grpo.num_prompts_per_step=4 "
        f"groups, so it must be a multiple of 4 (at least one step), got {ahead}."
    )


def test_asynchronous_runs_ahead_within_both_bounds_and_corrects_by_default():
    run_ahead = AsynchronousConfig(max_staleness_steps=3)
    assert run_ahead.enabled and run_ahead.rounds_ahead(4) == 3
    assert attrs.evolve(run_ahead, max_groups_ahead=8).rounds_ahead(4) == 2  # two steps of 4 groups
    assert not AsynchronousConfig().enabled and AsynchronousConfig().rounds_ahead(4) == 0
    effective = grpo(asynchronous=run_ahead).effective_loss()
    assert (effective.importance_sampling_correction, effective.is_min, effective.is_max) == ("tis", None, 2.0)
    own = grpo(asynchronous=run_ahead, loss=ClippedPGConfig(importance_sampling_correction="icepop", is_min=0.5, is_max=2))
    assert own.effective_loss() == own.loss  # the loss's own correction wins
    off = grpo(asynchronous=attrs.evolve(run_ahead, importance_sampling_correction=False))
    assert off.effective_loss().importance_sampling_correction is None
    bypass = grpo(asynchronous=run_ahead, loss=ClippedPGConfig(rollout_correction="bypass"))
    assert bypass.effective_loss() == bypass.loss  # bypass trains against the engine's logprobs: nothing to weigh
    assert grpo().effective_loss() == grpo().loss  # synchronous: the loss as configured


def test_exact_rollouts_make_a_synchronous_loss_bypass_the_previous_logprob_pass():
    """The engine's logprobs are the previous policy's in a synchronous run with exact
    logprobs: the decoupled loss takes them (bypass), its correction dropped (every weight is 1).
    Not asynchronously (the engine's are an older policy's), nor with the KL in the reward
    (its estimate takes the previous policy's logprobs, which bypass replaces)."""
    tis = grpo(loss=ClippedPGConfig(importance_sampling_correction="tis", is_max=2.0))
    assert tis.effective_loss(exact_rollouts=True) == ClippedPGConfig(rollout_correction="bypass")
    assert tis.effective_loss() == tis.loss
    run_ahead = grpo(asynchronous=AsynchronousConfig(max_staleness_steps=1))
    assert run_ahead.effective_loss(exact_rollouts=True) == run_ahead.effective_loss()
    assert run_ahead.effective_loss().rollout_correction == "decoupled"
    kl = grpo(loss=ClippedPGConfig(kl_penalty=0.1, kl_in_reward="token"))
    assert kl.effective_loss(exact_rollouts=True) == kl.loss


def test_constant_normalizer_defaults_to_the_generation_budget():
    dr_grpo = grpo(loss=ClippedPGConfig(token_normalizer="constant"))
    assert dr_grpo.effective_loss(max_new_tokens=64).constant_normalizer == 64
    given = grpo(loss=ClippedPGConfig(token_normalizer="constant", constant_normalizer=100))
    assert given.effective_loss(max_new_tokens=64).constant_normalizer == 100
    assert grpo().effective_loss(max_new_tokens=64).constant_normalizer is None


def test_two_keys_of_a_meaningless_combination_are_both_located(host, tmp_path):
    path = yaml_run(
        tmp_path,
        "grpo:\n"
        "  num_prompts_per_step: 2\n"
        "  num_generations_per_prompt: 8\n"
        "  loss:\n"
        "    rollout_correction: bypass\n"
        "    importance_sampling_correction: icepop\n"
        "    is_min: 0.5\n"
        "    is_max: 2\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, host=host)
    assert str(info.value).endswith(
        "Where set: grpo.loss.importance_sampling_correction at "
        f"{path}:9; grpo.loss.rollout_correction at {path}:8."
    )


def test_unknown_backends_refused_with_suggestion(host):
    config = attrs.evolve(run_config(), policy=PolicyConfig(backend="grpo-test-polcy", train_global_batch_size=16))
    with pytest.raises(ConfigError) as info:
        validate(host, config)
    assert str(info.value).startswith("policy.backend: unknown policy backend 'grpo-test-polcy'; installed: ")
    assert "Did you mean 'grpo-test-policy'?" in str(info.value)
    config = attrs.evolve(run_config(), generation=GenerationConfig(backend="nope"))
    with pytest.raises(ConfigError, match="generation.backend: unknown generation backend 'nope'"):
        validate(host, config)


def yaml_run(tmp_path, body: str):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        "algorithm: grpo\n"
        "policy: {backend: grpo-test-policy, train_global_batch_size: 16}\n"
        "generation: {backend: grpo-test-generation}\n" + body
    )
    return path


def test_yaml_structures_into_the_section(host, tmp_path):
    path = yaml_run(
        tmp_path,
        "grpo:\n"
        "  num_prompts_per_step: 2\n"
        "  num_generations_per_prompt: 8\n"
        "  dynamic_sampling: {enabled: true, max_gen_batches: 4}\n"
        "  loss: {kl_penalty: 0.01, kl_estimator: k2, importance_sampling_correction: tis, is_max: 2}\n",
    )
    config = load_config(path, host=host)
    grpo = config.section("grpo")
    assert isinstance(grpo, GRPOConfig) and isinstance(grpo.loss, ClippedPGConfig)
    assert grpo.dynamic_sampling == DynamicSamplingConfig(enabled=True, max_gen_batches=4)
    assert (grpo.loss.kl_estimator, grpo.loss.is_max) == ("k2", 2.0)


def test_yaml_error_says_where_the_keys_were_set(host, tmp_path):
    path = yaml_run(tmp_path, "grpo:\n  num_prompts_per_step: 3\n  num_generations_per_prompt: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, host=host)
    message = str(info.value)
    assert message == (  # core checks GRPO's batch-size rule (GRPOConfig.batch_size_rules) with its own
        "policy.train_global_batch_size=16 does not divide 12 (the samples of a GRPO step: grpo.num_prompts_per_step "
        "(3) x grpo.num_generations_per_prompt (4)). Use policy.train_global_batch_size=12. Where set: "
        f"policy.train_global_batch_size at {path}:2; grpo.num_prompts_per_step at {path}:5; "
        f"grpo.num_generations_per_prompt at {path}:6."
    )
    with pytest.raises(ConfigError, match=r"grpo.loss.kl_estimator.*'k4'"):
        load_config(yaml_run(tmp_path, "grpo: {loss: {kl_estimator: k4}}\n"), host=host)


def test_async_with_a_colocated_engine_names_where_both_keys_were_set(host, tmp_path):
    path = yaml_run(
        tmp_path,
        "grpo:\n"
        "  num_prompts_per_step: 2\n"
        "  num_generations_per_prompt: 8\n"
        "  asynchronous: {max_staleness_steps: 2}\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, host=host)
    assert str(info.value).endswith(
        "or max_staleness_steps=0 for synchronous GRPO. Where set: grpo.asynchronous.max_staleness_steps at "
        f"{path}:7."
    )  # generation.colocated is left at its default (true): nothing to point at


def test_async_with_engines_in_the_policys_workers_names_both_keys_and_the_advice_works(host, tmp_path):
    """``generation.in_policy_workers: true`` needs a colocated engine: the fix names both keys,
    and the run loads once both are changed as it says."""
    path = tmp_path / "grpo.yaml"
    path.write_text(
        "algorithm: grpo\n"
        "policy: {backend: grpo-test-policy, train_global_batch_size: 16}\n"
        "generation: {backend: hf, in_policy_workers: true}\n"
        "grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 8, asynchronous: {max_staleness_steps: 1}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(path), host=host)
    assert "Set generation.colocated=false and generation.in_policy_workers=false (the engines then" in str(info.value)
    assert str(info.value).endswith(f"generation.in_policy_workers at {path}:3.")
    config = load_config(str(path), ["generation.colocated=false", "generation.in_policy_workers=false"], host=host)
    assert (config.generation.colocated, config.generation.in_policy_workers) == (False, False)
