"""One evaluation pass: roll prompts out, ``n`` completions each, and score them.

:func:`evaluate` draws the completions through a :class:`~posttrain.run.prompt_rollout.Rollout`
(core's :class:`~posttrain.run.prompt_rollout.PromptRollout` for the ``eval`` algorithm) and
scores them (:mod:`posttrain_eval.metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from posttrain.batch import Batch
from posttrain.run.prompt_rollout import Rollout
from posttrain_eval.metrics import score_prompts


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
