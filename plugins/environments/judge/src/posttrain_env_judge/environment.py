"""The ``judge`` environment: an LLM reads each question and response and its verdict is the
reward (single turn: every episode ends).

For each conversation the judge prompt (``prompt``) is filled with the first user message
(``{question}``), the last assistant message (``{response}``) and the row's answer
(``{reference}``, '' without one). The judge (:mod:`posttrain_env_judge.judges`: a local model
or an OpenAI-compatible endpoint) answers, and ``verdict`` turns the answer into a reward
(:mod:`posttrain_env_judge.verdicts`).

A verdict that cannot be had scores 0, is counted and logged, and the run goes on: a reply
without a verdict (``unparsable``), or a request that timed out or failed after its retries
(``request_timeouts``, ``request_errors``). A prompt judged once is not judged again
(``cache``), except after a failed request. Metrics per batch: ``mean_score`` and the counts
above, plus ``cached``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain.log import get_logger
from posttrain_env_judge.judges import EndpointJudge, ModelJudge, Reply
from posttrain_env_judge.options import JudgeOptions
from posttrain_env_judge.verdicts import label_verdict, number_verdict, probability_verdict

#: The per-sample metadata key that records how its verdict went.
OUTCOME_KEY = "judge_outcome"
#: Outcomes, as counted in the metrics.
OUTCOME_METRICS = {"unparsable": "unparsable", "timeout": "request_timeouts", "error": "request_errors",
                   "cached": "cached"}
_QUOTED = 200  # characters of a reply quoted in a log line


class JudgeEnvironment(Environment):
    def __init__(self, options: JudgeOptions):
        self.options = options
        self.judge = ModelJudge(options) if options.model is not None else EndpointJudge(options)
        self.verdicts: dict[str, float | None] = {}  # prompt -> reward (None: unparsable)

    def prompt_of(self, log: Sequence[Message], metadata: Any) -> str:
        question = next((m["content"] for m in log if m["role"] == "user"), "")
        response = next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
        reference = metadata.get("answer") if isinstance(metadata, Mapping) else None
        return self.options.prompt.format(question=question, response=response,
                                          reference="" if reference is None else str(reference))

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        prompts = [self.prompt_of(log, meta) for log, meta in zip(message_logs, metadata, strict=True)]
        asked = list(dict.fromkeys(p for p in prompts if not (self.options.cache and p in self.verdicts)))
        judged = {prompt: self.judged(reply) for prompt, reply in zip(asked, self.judge.ask(asked), strict=True)}
        if self.options.cache:
            self.verdicts.update({prompt: reward for prompt, (reward, outcome) in judged.items()
                                  if outcome in ("ok", "unparsable")})
        rewards, outcomes = [], []
        for prompt in prompts:
            if prompt in judged:
                reward, outcome = judged[prompt]
            else:  # judged by an earlier step
                reward = self.verdicts[prompt]
                outcome = "cached" if reward is not None else "unparsable"
            rewards.append(0.0 if reward is None else reward)
            outcomes.append(outcome)
        final = [{**(meta if isinstance(meta, Mapping) else {}), OUTCOME_KEY: outcome}
                 for meta, outcome in zip(metadata, outcomes, strict=True)]
        return EnvironmentReturn.final(rewards, final)

    def judged(self, reply: Reply) -> tuple[float | None, str]:
        """The reward of one reply (None: none) and its outcome (``ok``, ``unparsable``, or the
        request's failure), each failure logged."""
        if reply.failure is not None:
            get_logger().warning("judge request failed", outcome=reply.failure, detail=reply.detail[:_QUOTED])
            return None, reply.failure
        reward = self.verdict(reply)
        if reward is None:
            get_logger().warning("judge reply without a verdict", verdict=self.options.verdict,
                                 reply=(reply.text or str(reply.probabilities))[:_QUOTED])
            return None, "unparsable"
        return reward, "ok"

    def verdict(self, reply: Reply) -> float | None:
        options = self.options
        if options.verdict == "token_probability":
            return probability_verdict(reply.probabilities or {}, options.labels)
        if options.verdict == "number":
            return number_verdict(reply.text or "", options.max_score)
        return label_verdict(reply.text or "", options.labels)

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """``mean_score``, and how many samples were ``unparsable``, ``request_timeouts``,
        ``request_errors`` or ``cached``."""
        outcomes = [meta.get(OUTCOME_KEY) if isinstance(meta, Mapping) else None for meta in metadata]
        counts = {name: float(outcomes.count(outcome)) for outcome, name in OUTCOME_METRICS.items()}
        return {"mean_score": float(rewards.mean()) if len(rewards) else 0.0, **counts}
