"""The arithmetic of one GRPO step on rollout batches, and its metrics.

Pure functions of :class:`~posttrain.batch.Batch` es and tensors: no backend is called here.
:func:`score` turns a rollout batch's environment rewards into advantages;
:func:`rollout_summary` and :func:`batch_metrics` build the step's logged metrics (with
core's :func:`~posttrain.run.metrics.combine_train_passes` for the training passes);
:func:`nonfinite_fields` diagnoses a diverged step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch

from posttrain.batch import Batch
from posttrain.errors import ConfigError, PosttrainError
from posttrain.run.rollout import REWARD_COMPONENT_PREFIX
from posttrain_grpo.advantages import consecutive_group_ids, grpo_advantages
from posttrain_grpo.config import GRPOConfig
from posttrain_grpo.rewards import mask_truncated, overlong_penalty, scale_rewards

#: What the logprob passes read from the data plane.
LOGPROB_FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
#: What a step puts into the data plane; ``policy.train`` reads these back, with
#: ``prev_logprobs`` and (with a KL penalty) ``reference_logprobs`` added by the logprob passes.
TRAIN_FIELDS = (*LOGPROB_FIELDS, "advantages", "generation_logprobs")
#: Per-sample values :func:`batch_metrics` reads: small, fetched for the trained samples.
METRIC_FIELDS = ("sample_mask", "advantages", "input_lengths", "shaped_rewards", "prompt_lengths", "response_lengths")
#: What an asynchronous step's training pass reads besides: each token's weight version and the
#: version the step trains (put by the step), for the loss's staleness buckets of its mismatch metrics.
STALENESS_FIELDS = ("generation_versions", "trained_version")
#: What a rollout puts into the step's partition.
ROLLOUT_FIELDS = tuple(dict.fromkeys((*TRAIN_FIELDS, *METRIC_FIELDS)))
#: The tag dynamic sampling decides on: the scaled reward before length shaping.
SIGNAL_TAG = "signal_reward"
#: The tag staleness is decided on: the oldest weight version that generated the sample.
VERSION_TAG = "weight_version"
#: The name of the overlong penalty among the reward parts of ``reward_aggregation: normalize_then_sum``.
OVERLONG_PART = "overlong"
#: Rollout metrics that are counts: summed over a step's rollouts; every other one is averaged.
_COUNT_SUFFIXES = ("/errors", "/timeouts", "/retried", "/generated_tokens", "/samples")


class TrainingDiverged(PosttrainError):
    """A training step produced a non-finite loss or gradient norm."""


def score(batch: Batch, grpo: GRPOConfig, max_new_tokens: int) -> torch.Tensor:
    """Add ``shaped_rewards`` and ``advantages`` (float32 [B]) to a rollout batch laid out as
    consecutive groups of ``grpo.num_generations_per_prompt`` samples, and apply overlong
    filtering to ``sample_mask``. ``rewards`` (the environments' sum) is left unchanged.

    Order: reward scaling, then the overlong length penalty (``shaped_rewards``), overlong
    filtering, then group advantages of the shaped rewards (over the samples that train, with
    ``grpo.baseline_valid_only``; whitened over them, with ``grpo.whiten_advantages``).
    Samples the environments could not score (the rollout's ``failed``) never train and never
    count: ``sample_mask`` 0, advantage 0, and their group's baseline and std are computed
    over its other samples (a group left with one scored sample gives it advantage 0).
    Returns the scaled rewards *before* shaping, NaN for failed samples: the signal dynamic
    sampling decides on (a length penalty must not make a group of equally wrong answers look
    informative).
    """
    scaled = scale_rewards(batch["rewards"].float(), grpo.reward_scaling)
    parts = {name[len(REWARD_COMPONENT_PREFIX):]: batch[name] for name in batch.keys()
             if name.startswith(REWARD_COMPONENT_PREFIX)}
    shaped = scaled
    shaping = grpo.overlong_reward_shaping
    if shaping.enabled:
        penalty = overlong_penalty(
            batch["response_lengths"],
            max_response_length=shaping.max_response_length or max_new_tokens,
            buffer_length=shaping.buffer_length,
            penalty=shaping.penalty,
            beyond_max=shaping.beyond_max,
        )
        shaped = scaled + penalty
        parts[OVERLONG_PART] = penalty
    groups = consecutive_group_ids(len(batch), grpo.num_generations_per_prompt)
    scored = ~batch["failed"] if "failed" in batch else torch.ones(len(batch), dtype=torch.bool)
    batch["sample_mask"] = batch["sample_mask"] * scored.to(batch["sample_mask"].dtype)
    if grpo.overlong_filtering:
        batch["sample_mask"] = mask_truncated(batch["sample_mask"], batch["truncated"])
    batch["shaped_rewards"] = shaped
    tokens = batch["token_mask"].sum(dim=1) if grpo.whiten_advantages == "tokens" else None
    rewards = reward_parts(parts, grpo) if grpo.reward_aggregation == "normalize_then_sum" else shaped
    batch["advantages"] = grpo_advantages(rewards, groups, grpo, trained=batch["sample_mask"] > 0, scored=scored,
                                          token_counts=tokens)
    return torch.where(scored, scaled, torch.nan)


def reward_parts(parts: Mapping[str, torch.Tensor], grpo: GRPOConfig) -> torch.Tensor:
    """float32 [B, K]: the named reward parts in alphabetical order, for GDPO; refuses fewer
    than two parts, or ``grpo.reward_weights`` of another length."""
    names = sorted(parts)
    if len(names) < 2:
        raise ConfigError(
            "grpo.reward_aggregation=normalize_then_sum normalises each named reward part apart and needs at least "
            f"two, but the environments reported {', '.join(names) or 'none'} (EnvironmentReturn.reward_components"
            f"{'; the overlong penalty is one more' if OVERLONG_PART not in names else ''}); use an environment that "
            "reports its reward's parts, or grpo.reward_aggregation=sum."
        )
    weights = grpo.reward_weights
    if weights is not None and len(weights) != len(names):
        raise ConfigError(
            f"grpo.reward_weights: {len(weights)} weights for the {len(names)} reward parts {', '.join(names)} "
            "(alphabetical order); give one weight per part."
        )
    return torch.stack([parts[name].float() for name in names], dim=1)


def sample_versions(batch: Batch, default: int) -> torch.Tensor:
    """int64 [B]: the oldest weight version among each sample's generated tokens
    (``generation_versions``); ``default`` for a sample without generated tokens, and for
    every sample of a batch without ``generation_versions``."""
    if "generation_versions" not in batch:
        return torch.full((len(batch),), default, dtype=torch.long)
    versions = batch["generation_versions"]
    generated = versions >= 0
    oldest = torch.where(generated, versions, torch.iinfo(torch.long).max).amin(dim=1)
    return torch.where(generated.any(dim=1), oldest, default)


def staleness_metrics(step: int, versions: torch.Tensor, stale_groups: torch.Tensor) -> dict[str, float]:
    """Metrics of step ``step`` (which trains weights of version ``step - 1``) on samples
    whose oldest versions are ``versions`` [B], of which the groups ``stale_groups`` (bool
    [groups]) were dropped: ``async/staleness_mean`` and ``async/staleness_max`` over the
    trained samples (versions behind), ``async/dropped_groups`` and ``async/groups_trained``."""
    staleness = ((step - 1) - versions).float()
    kept = ~stale_groups.repeat_interleave(versions.numel() // stale_groups.numel())
    trained = staleness[kept]
    return {
        "async/staleness_mean": float(trained.mean()) if trained.numel() else 0.0,
        "async/staleness_max": float(trained.max()) if trained.numel() else 0.0,
        "async/dropped_groups": float(stale_groups.sum()),
        "async/groups_trained": float((~stale_groups).sum()),
    }


def sample_keys(num_prompts: int, group_size: int, first_prompt: int = 0) -> list[str]:
    """Data-plane keys of a batch's samples: ``"<prompt>_g<generation>"`` in batch order,
    prompts numbered from ``first_prompt`` (the prompts of the step's earlier rollouts)."""
    return [f"{prompt}_g{gen}" for prompt in range(first_prompt, first_prompt + num_prompts) for gen in range(group_size)]


def step_seed(seed: int, phase: str, step: int) -> int:
    """A 31-bit sampling seed for ``phase`` (``train`` or ``validation``) of ``step``,
    derived from the run's seed alone, so a resumed run draws what an uninterrupted one would."""
    digest = hashlib.blake2b(f"{seed}:{phase}:{step}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def rollout_summary(rollouts: Sequence[tuple[Batch, Mapping[str, float]]]) -> dict[str, float]:
    """The step's rollout metrics over every rollout it ran (one, or several with dynamic
    sampling): counts (``.../errors``, ``.../timeouts``, ``.../retried``, ``rollout/generated_tokens``)
    and seconds (``timing/...``) are summed, other metrics averaged weighted by each rollout's
    samples (a mixture source's ``data/<tag>/...`` by that source's samples); ``reward`` is the
    mean environment reward over every generated sample the environments scored (the
    rollout's ``failed`` ones left out; 0 when none was scored)."""
    sizes = [len(batch) for batch, _ in rollouts]
    out: dict[str, float] = {}
    for name in dict.fromkeys(n for _, metrics in rollouts for n in metrics):
        weight_of = f"{name.rpartition('/')[0]}/samples" if name.startswith("data/") else None
        present = [(metrics.get(weight_of, size) if weight_of else size, metrics[name])
                   for size, (_, metrics) in zip(sizes, rollouts, strict=True) if name in metrics]
        if name.endswith(_COUNT_SUFFIXES) or name.startswith("timing/"):
            out[name] = float(sum(value for _, value in present))
        else:
            out[name] = sum(size * value for size, value in present) / sum(size for size, _ in present)
    scored = torch.cat([batch["rewards"].float()[~batch["failed"]] if "failed" in batch else batch["rewards"].float()
                        for batch, _ in rollouts])
    out["reward"] = float(scored.mean()) if scored.numel() else 0.0
    return out


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Metrics of the batch the step trains on (after dynamic sampling and filtering)."""
    valid = batch["sample_mask"] > 0
    advantages = batch["advantages"].float()
    lengths = batch["input_lengths"].float()
    return {
        "trained_reward": float(batch["shaped_rewards"].float().mean()),
        "advantages/mean": float(advantages.mean()),
        "advantages/min": float(advantages.min()),
        "advantages/max": float(advantages.max()),
        "num_valid_samples": float(valid.sum()),
        "mean_prompt_length": float(batch["prompt_lengths"].float().mean()),
        "mean_response_length": float(batch["response_lengths"].float().mean()),
        "max_sequence_length": float(lengths.max()),
        "total_num_tokens": float(lengths.sum()),
    }


def throughput(num_tokens: float, generated_tokens: float, timings: Mapping[str, float]) -> dict[str, float]:
    """Tokens per second: ``throughput/tokens_per_s`` (all tokens of the trained batch over
    the whole step), ``throughput/generated_tokens_per_s`` (over the rollout stage) and
    ``throughput/training_tokens_per_s`` (over the training stage)."""
    out = {}
    for name, tokens, stage in (
        ("tokens_per_s", num_tokens, "timing/step"),
        ("generated_tokens_per_s", generated_tokens, "timing/rollout"),
        ("training_tokens_per_s", num_tokens, "timing/training"),
    ):
        if timings.get(stage):
            out[f"throughput/{name}"] = tokens / timings[stage]
    return out


def nonfinite_fields(batch: Batch) -> list[str]:
    """Names of the batch's floating-point tensor fields that hold a NaN or an infinity."""
    return [
        name
        for name, value in batch.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all())
    ]


def first_nonfinite(metrics: Mapping[str, float], names: Sequence[str]) -> str | None:
    """The first of ``names`` whose value in ``metrics`` is NaN or infinite, or None."""
    for name in names:
        if name in metrics and not math.isfinite(metrics[name]):
            return name
    return None
