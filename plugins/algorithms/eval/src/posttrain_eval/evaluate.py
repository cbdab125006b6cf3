"""One evaluation pass: roll prompts out, ``n`` completions each, and score them.

:class:`PromptRollout` rolls a batch of prompts (a prompt dataset's collated rows) out
through a generation backend and the environments (core's
:func:`~posttrain.run.rollout.run_rollout`); :func:`evaluate` draws the completions and scores
them (:mod:`posttrain_eval.metrics`). GRPO's validation and the ``eval`` algorithm both run
through here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from posttrain.batch import Batch
from posttrain.interfaces import Environment, Generation
from posttrain.run.rollout import run_rollout
from posttrain_eval.metrics import score_prompts

#: Per-sample fields of a prompt batch that the rollout reads.
PROMPT_FIELDS = ("messages", "task", "metadata", "answer")


class Rollout(Protocol):
    """``rollout(prompts, greedy=..., repeats=...)``: each prompt ``repeats`` times in a row,
    rolled out; the rollout batch and its metrics (see :func:`~posttrain.run.rollout.run_rollout`)."""

    def __call__(self, prompts: Batch, *, greedy: bool, repeats: int) -> tuple[Batch, dict[str, float]]: ...


@attrs.frozen
class PromptRollout:
    """A :class:`Rollout` through ``generation`` and ``environments``: conversations of at
    most ``max_turns`` turns and ``max_total_length`` tokens, rendered with ``chat_template``
    (None: the tokenizer's); a row without a ``task`` goes to ``default_task``."""

    generation: Generation
    environments: Mapping[str, Environment]
    tokenizer: Any
    max_total_length: int
    max_turns: int = 1
    chat_template: str | None = None
    default_task: str | None = None

    def __call__(self, prompts: Batch, *, greedy: bool, repeats: int) -> tuple[Batch, dict[str, float]]:
        samples = prompts.fields(PROMPT_FIELDS)
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
        )


@attrs.frozen
class Evaluation:
    """What :func:`evaluate` found. ``metrics``: ``mean_reward``, ``mean_response_length``
    (generated tokens per completion) and ``pass_at_<k>``, ``maj_at_<k>`` for each k asked;
    ``rollout_metrics``: the rollout's (``rollout/*``, ``env/*``); ``batch``: the rollout batch,
    prompt p's completions at rows ``p * num_samples`` to ``p * num_samples + num_samples - 1``."""

    metrics: dict[str, float]
    rollout_metrics: dict[str, float]
    batch: Batch
    num_samples: int

    def records(self, correct_reward: float) -> list[dict[str, Any]]:
        """One JSON-ready record per completion: prompt and sample index, the final
        conversation, the environment's answer, the reward, whether it is correct (reward at
        least ``correct_reward``) and whether it was cut by a length limit."""
        batch, n = self.batch, self.num_samples
        return [
            {
                "prompt": i // n,
                "sample": i % n,
                "messages": [{"role": m["role"], "content": m["content"]} for m in batch["messages"][i]],
                "answer": batch["answers"][i],
                "reward": float(batch["rewards"][i]),
                "correct": bool(batch["rewards"][i] >= correct_reward),
                "truncated": bool(batch["truncated"][i]),
            }
            for i in range(len(batch))
        ]


def evaluate(
    prompts: Batch,
    rollout: Rollout,
    *,
    num_samples: int = 1,
    greedy: bool = False,
    ks: Sequence[int] = (),
    correct_reward: float = 1.0,
) -> Evaluation:
    """Draw ``num_samples`` completions of every prompt (argmax ones when ``greedy``) and
    score them: the mean reward and response length over all completions, and pass@k and
    maj@k for each k of ``ks`` (a k above ``num_samples`` is refused), a completion being
    correct when its reward is at least ``correct_reward``."""
    too_large = [k for k in ks if k > num_samples]
    if too_large:
        raise ValueError(f"pass@k and maj@k for k={too_large[0]} need at least {too_large[0]} completions per prompt, "
                         f"but {num_samples} are drawn")
    batch, rollout_metrics = rollout(prompts, greedy=greedy, repeats=num_samples)
    rewards = batch["rewards"]
    metrics = {
        "mean_reward": float(rewards.float().mean()),
        "mean_response_length": float(batch["response_lengths"].float().mean()),
    }
    if ks:
        rows = [range(p * num_samples, (p + 1) * num_samples) for p in range(len(prompts))]
        per_prompt = [[float(rewards[i]) for i in row] for row in rows]
        answers = [[batch["answers"][i] for i in row] for row in rows]
        metrics.update(score_prompts(per_prompt, answers, ks, correct_reward))
    return Evaluation(metrics, rollout_metrics, batch, num_samples)


def validate_greedy(prompts: Batch, rollout: Rollout, generation: Generation, seed: int) -> dict[str, float]:
    """The validation of rollout algorithms (GRPO, distillation): one greedy completion of
    each prompt, with ``generation`` prepared for it and reseeded with ``seed``. Returns
    ``accuracy`` (the mean environment reward: pass@1 when rewards are 0 or 1),
    ``mean_response_length`` and the rollout metrics."""
    generation.set_sampling_seed(seed)
    generation.prepare_for_generation()
    try:
        result = evaluate(prompts, rollout, greedy=True)
    finally:
        generation.finish_generation()
    return {
        "accuracy": result.metrics["mean_reward"],
        "mean_response_length": result.metrics["mean_response_length"],
        **result.rollout_metrics,
    }
