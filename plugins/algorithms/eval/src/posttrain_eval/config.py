"""The ``eval`` config section and its checks. Imports only attrs and core's config helpers:
the plugin module declaring it stays light."""

from __future__ import annotations

from typing import Any

import attrs

from posttrain.config.demands import Demand, generation_demand, policy_demand
from posttrain.config.schema import RunConfig
from posttrain.config.validate import where_set


@attrs.define
class EvalConfig:
    """Options of the ``eval`` algorithm: the prompts of ``data.validation`` (or its first
    ``max_prompts``), ``num_samples`` completions each from ``generation.backend``, scored by
    the environments their rows name (or the one configured). Metrics: ``mean_reward``,
    ``pass_at_<k>`` and ``maj_at_<k>`` for each ``k`` (:mod:`posttrain_eval.metrics`),
    ``mean_response_length`` and the rollout metrics."""

    num_samples: int = 1  # completions drawn per prompt (n >= 1); pass@k and maj@k need n >= k
    k: list[int] = attrs.field(factory=lambda: [1])  # the k of pass@k and maj@k, each between 1 and num_samples
    # argmax decoding: one completion per prompt (num_samples 1); false: sampling at generation.temperature
    greedy: bool = False
    correct_reward: float = 1.0  # a completion counts as correct (pass@k, maj@k) when its reward is at least this
    max_prompts: int | None = None  # evaluate the first N prompts of data.validation; None: all of them
    max_rollout_turns: int = 1  # turns per conversation at most (multi-turn environments)
    # a step_N folder of a run's checkpoints: its policy weights are loaded by policy.backend and sent to the
    # engines (the run's config: policy.model, policy.backend); None: the engines keep generation.model
    checkpoint: str | None = None
    # every completion (prompt, conversation, answer, reward, correct) as JSON Lines, under run_dir unless
    # absolute; None: not written
    samples_file: str | None = "samples.jsonl"

    def cluster_demands(self, config: RunConfig) -> list[Demand]:
        """The engines' workers (beside no policy), and with ``checkpoint`` the policy's,
        which load its weights into them while they run."""
        engines = generation_demand(config, beside_policy=False)
        assert engines is not None  # engines beside no policy always have a group of their own
        return [engines, *([policy_demand(config.policy)] if self.checkpoint else [])]


def check_eval_config(options: EvalConfig, config: Any) -> list[str]:
    """Problems with the ``eval`` section of ``config`` (a RunConfig), each naming its key,
    what was expected and what was found, and where the key was set."""
    problems = []

    def problem(message: str, *keys: str) -> None:
        problems.append(message + where_set(config, *keys))

    n = options.num_samples
    if n < 1:
        problem(f"eval.num_samples: expected at least 1 completion per prompt, found {n}.", "eval.num_samples")
    if options.greedy and n > 1:
        problem(
            f"eval.num_samples: greedy decoding gives one completion per prompt, found num_samples={n}; set "
            "eval.greedy=false to sample several, or num_samples=1.", "eval.num_samples", "eval.greedy",
        )
    if not options.k:
        problem("eval.k: expected at least one k (e.g. [1]), found an empty list.", "eval.k")
    for k in options.k:
        if k < 1:
            problem(f"eval.k: expected each k to be at least 1, found {k}.", "eval.k")
        elif n >= 1 and k > n:
            problem(
                f"eval.k: pass@{k} and maj@{k} need at least {k} completions per prompt, but eval.num_samples is {n}; "
                f"raise eval.num_samples to {k} or leave k={k} out.", "eval.k", "eval.num_samples",
            )
    if options.max_prompts is not None and options.max_prompts < 1:
        problem(f"eval.max_prompts: expected a positive number or null, found {options.max_prompts}.", "eval.max_prompts")
    if options.max_rollout_turns < 1:
        problem(f"eval.max_rollout_turns: expected at least 1, found {options.max_rollout_turns}.", "eval.max_rollout_turns")
    return problems
