"""Prompts rolled out: what validation and evaluation of rollout algorithms run through.

:class:`PromptRollout` rolls a batch of prompts (a prompt dataset's collated rows) out
through a generation backend and the environments (:func:`~posttrain.run.rollout.run_rollout`);
:func:`validate_greedy` is the validation of rollout algorithms (GRPO, distillation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from posttrain.batch import Batch
from posttrain.data.images import ENCODED_IMAGES, ImageInputs, image_fields
from posttrain.interfaces import Environment, Generation
from posttrain.run.rollout import run_rollout

#: Per-sample fields of a prompt batch that the rollout reads (``origin`` and ``source``: when the batch has them).
PROMPT_FIELDS = ("messages", "task", "metadata", "answer", "origin", "source")
#: Fields of :data:`PROMPT_FIELDS` that a prompt batch may lack.
OPTIONAL_FIELDS = ("origin", "source")


class Rollout(Protocol):
    """``rollout(prompts, greedy=..., repeats=...)``: each prompt ``repeats`` times in a row,
    rolled out; the rollout batch and its metrics (see :func:`~posttrain.run.rollout.run_rollout`)."""

    def __call__(self, prompts: Batch, *, greedy: bool, repeats: int) -> tuple[Batch, dict[str, float]]: ...


@attrs.frozen
class PromptRollout:
    """A :class:`Rollout` through ``generation`` and ``environments``: conversations of at
    most ``max_turns`` turns and ``max_total_length`` tokens, rendered with ``chat_template``
    (None: the tokenizer's); a row without a ``task`` goes to ``default_task``; a
    vision-language model's ``images`` widen the prompts' image placeholders."""

    generation: Generation
    environments: Mapping[str, Environment]
    tokenizer: Any
    max_total_length: int
    max_turns: int = 1
    chat_template: str | None = None
    default_task: str | None = None
    images: ImageInputs | None = None

    def __call__(self, prompts: Batch, *, greedy: bool, repeats: int) -> tuple[Batch, dict[str, float]]:
        names = [name for name in PROMPT_FIELDS if name not in OPTIONAL_FIELDS or name in prompts]
        samples = prompts.fields([*names, *image_fields(prompts), *([ENCODED_IMAGES] if ENCODED_IMAGES in prompts else [])])
        samples["task"] = [task or self.default_task for task in samples["task"]]
        return run_rollout(
            samples.repeat_interleave(repeats),
            self.generation,
            self.environments,
            self.tokenizer,
            max_total_length=self.max_total_length,
            max_turns=self.max_turns,
            greedy=greedy,
            chat_template=self.chat_template,
            images=self.images,
        )


def validate_greedy(prompts: Batch, rollout: Rollout, generation: Generation, seed: int) -> dict[str, float]:
    """One greedy completion of each prompt, with ``generation`` prepared for it and reseeded
    with ``seed``. Returns ``accuracy`` (the mean environment reward: pass@1 when rewards
    are 0 or 1), ``mean_response_length`` (generated tokens per completion) and the rollout
    metrics."""
    generation.set_sampling_seed(seed)
    generation.prepare_for_generation()
    try:
        batch, rollout_metrics = rollout(prompts, greedy=True, repeats=1)
    finally:
        generation.finish_generation()
    return {
        "accuracy": rollout_metrics["rollout/mean_reward"],
        "mean_response_length": float(batch["response_lengths"].float().mean()),
        **rollout_metrics,
    }
