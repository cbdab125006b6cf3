"""The ``distill`` config section and its checks. Imports only attrs and core's config:
the plugin module declaring it stays light."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from posttrain.config.demands import Demand, generation_demand, policy_demand
from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.config.validate import where_set

KL = Literal["reverse", "forward", "mixed"]


@attrs.define
class DistillConfig:
    """Options of the ``distill`` algorithm: on-policy distillation. The student (``policy``)
    samples completions of the training prompts (``generation``); the teacher (its own
    worker group, in eval mode) gives its top-``topk`` logits at every position of those
    completions; the student trains on the per-token KL between the two
    (:mod:`posttrain_distill.loss`), then its new weights go to the engines. The teacher must
    use the student's tokenizer."""

    # the teacher: its model (required), backend, dtype, parallel sizes, logprob_micro_batch_size and
    # resources; its optimizer and training batch sizes are not used
    teacher: PolicyConfig = attrs.field(factory=PolicyConfig)
    topk: int = 64  # teacher logits kept per position (the KL's support), >= 1 and at most the vocabulary
    # reverse: KL(student || teacher) on the teacher's top-k; forward: KL(teacher || student); mixed: both
    kl: KL = "reverse"
    forward_weight: float = 0.5  # mixed: the forward KL's weight in [0, 1], the reverse KL's is 1 - it
    num_prompts_per_step: int = 32  # prompts per step (the data loader's batch)
    # completions per prompt; a step's samples (num_prompts_per_step x this) must be a multiple of
    # policy.train_global_batch_size: one optimizer step each
    num_generations_per_prompt: int = 1
    max_num_steps: int = 1_000_000  # training steps at most
    max_num_epochs: int = 1  # passes over the training prompts; the run ends when they are used up
    val_period: int = 0  # steps between validations (greedy rollouts of data.validation); 0: none in training
    val_at_start: bool = False  # validate before the first step (fresh runs, not resumed ones)
    max_val_samples: int | None = None  # validation prompts used per validation; None: all
    max_rollout_turns: int = 1  # assistant turns per sample at most; multi-turn environments need more than 1
    export_dir: str | None = None  # write a Hugging Face folder of the student's final weights here

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt

    def cluster_demands(self, config: RunConfig) -> list[Demand]:
        """The student's workers, the teacher's and the engines'."""
        parts = [policy_demand(config.policy), policy_demand(self.teacher, name="teacher", prefix="distill.teacher"),
                 generation_demand(config)]
        return [d for d in parts if d is not None]


def check_distill_config(options: DistillConfig, config: Any) -> list[str]:
    """Problems with the ``distill`` section of ``config`` (a RunConfig), each naming its key,
    what was expected and what was found, and where the key was set."""
    problems = []

    def problem(message: str, *keys: str) -> None:
        problems.append(message + where_set(config, *keys))

    if not options.teacher.model:
        problem("distill.teacher.model is empty; set it to the teacher's Hugging Face folder.", "distill.teacher.model")
    if options.teacher.head != "lm":
        problem(f"distill.teacher.head: the teacher is a language model (lm), found '{options.teacher.head}'.",
                "distill.teacher.head")
    for name in ("topk", "num_prompts_per_step", "num_generations_per_prompt", "max_num_epochs", "max_rollout_turns"):
        if getattr(options, name) < 1:
            problem(f"distill.{name}: expected at least 1, found {getattr(options, name)}.", f"distill.{name}")
    if options.max_num_steps < 0 or options.val_period < 0:
        problem("distill.max_num_steps and distill.val_period: expected 0 or more, found "
                f"{options.max_num_steps} and {options.val_period}.", "distill.max_num_steps", "distill.val_period")
    if not 0.0 <= options.forward_weight <= 1.0:
        problem(f"distill.forward_weight: expected a weight in [0, 1], found {options.forward_weight}.",
                "distill.forward_weight")
    gbs = config.policy.train_global_batch_size
    if gbs >= 1 and options.samples_per_step % gbs:
        problem(
            f"policy.train_global_batch_size: distill.num_prompts_per_step * distill.num_generations_per_prompt = "
            f"{options.samples_per_step} samples per step is not a multiple of policy.train_global_batch_size = {gbs}; "
            f"choose a train_global_batch_size that divides {options.samples_per_step}.",
            "distill.num_prompts_per_step", "distill.num_generations_per_prompt", "policy.train_global_batch_size",
        )
    return problems
