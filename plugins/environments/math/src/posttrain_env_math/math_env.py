"""The ``math`` environment: is the last assistant message's final answer right?

Options (``environments.math``): ``timeout_s`` (per response, extraction and verification
together; default 10) and ``num_workers`` (verifier processes; default 2).

Each sample's metadata must hold the ground truth under ``"answer"`` (a string, or a
number). The answer is extracted by the rule in :mod:`posttrain_env_math.extract` and
compared with math-verify. Reward 1.0 when equal, else 0.0; one turn (always terminated,
empty observation). A response whose scoring exceeds ``timeout_s`` scores 0.0 and is counted
in ``verify_timeouts``; a sample without a readable ground truth is reported as a
per-sample error.

Returned metadata: the input metadata plus ``extracted_answer`` (``None`` when none) and
``verify_status`` (``ok``, ``timeout`` or ``error``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.deadline_pool import DeadlinePool
from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain_env_math.options import MathOptions


class MathEnvironment(Environment):
    def __init__(self, options: MathOptions):
        from posttrain_env_math.scoring import score_response  # imports sympy: only where it is used

        self.options = options
        self._pool = DeadlinePool(score_response, num_workers=options.num_workers, timeout_s=options.timeout_s)

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        errors: list[str | None] = [_metadata_problem(meta) for meta in metadata]
        to_score = [i for i, problem in enumerate(errors) if problem is None]
        results = self._pool.map([(last_assistant_text(message_logs[i]), str(metadata[i]["answer"])) for i in to_score])
        answers: list[str | None] = [None] * len(message_logs)
        rewards = torch.zeros(len(message_logs), dtype=torch.float32)
        statuses = ["error"] * len(message_logs)
        for i, result in zip(to_score, results, strict=True):
            statuses[i] = result.status
            if result.status == "ok":
                answers[i], correct = result.value
                rewards[i] = float(correct)
            elif result.status == "error":
                errors[i] = f"verifying the answer failed: {result.error}"
        out_metadata = [
            {**(meta if isinstance(meta, Mapping) else {}), "extracted_answer": answer, "verify_status": status}
            for meta, answer, status in zip(metadata, answers, statuses, strict=True)
        ]
        return EnvironmentReturn.final(rewards, out_metadata, answers=answers, errors=errors)

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """``accuracy`` (mean reward: rewards are 1 or 0), ``answer_rate`` (fraction of
        responses with an extractable answer) and ``verify_timeouts`` (a count)."""
        if not metadata:
            return {}
        extracted = [isinstance(m, Mapping) and m.get("extracted_answer") is not None for m in metadata]
        timeouts = [isinstance(m, Mapping) and m.get("verify_status") == "timeout" for m in metadata]
        return {
            "accuracy": float(rewards.float().mean()),
            "answer_rate": sum(extracted) / len(metadata),
            "verify_timeouts": float(sum(timeouts)),
        }

    def shutdown(self) -> None:
        self._pool.close()


def last_assistant_text(message_log: Sequence[Message]) -> str:
    """The content of the last assistant message ("" when there is none)."""
    for message in reversed(message_log):
        if message.get("role") == "assistant":
            return str(message.get("content", ""))
    return ""


def _metadata_problem(meta: Any) -> str | None:
    if not isinstance(meta, Mapping) or meta.get("answer") is None:
        return "the sample's metadata has no 'answer' (the ground truth the math environment compares with)"
    return None

