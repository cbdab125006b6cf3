"""Environments: score model outputs, and for multi-turn tasks answer them.

A message log is a list of messages ``{"role": str, "content": str}`` (the rollout adds
``"token_ids"`` to each). Environments see whole logs and return one result per log.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import attrs
import torch


class Message(TypedDict, total=False):
    role: str
    content: str
    token_ids: list[int]


@attrs.frozen
class EnvironmentReturn:
    """One environment step over a batch of B message logs."""

    observations: list[Message]  # the message to append to each log (content may be "")
    metadata: list[Any]  # per-sample state passed back on the next turn
    next_stop_strings: list[list[str] | None]  # stop strings for the next generation
    rewards: torch.Tensor  # float32 [B]
    terminateds: torch.Tensor  # bool [B]: the episode is over
    answers: list[str | None] = attrs.field(factory=list)  # extracted answers, for logs
    # Per-sample failures (a message, or None): an environment that cannot score one sample
    # reports it here instead of raising, so only that sample gets reward 0. [] = none failed.
    errors: list[str | None] = attrs.field(factory=list)
    # Named parts of the reward, float32 [B] each (e.g. "correct" and "format"), for advantage
    # estimators that normalise them apart (GRPO's reward_aggregation: normalize_then_sum). They
    # need not sum to ``rewards``. {} = none.
    reward_components: dict[str, torch.Tensor] = attrs.field(factory=dict)

    @classmethod
    def final(
        cls,
        rewards: torch.Tensor | Sequence[float],
        metadata: Sequence[Any],
        *,
        answers: Sequence[str | None] = (),
        errors: Sequence[str | None] = (),
        reward_components: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
    ) -> EnvironmentReturn:
        """The result of a single-turn step: every episode ends with these rewards (stored
        as float32 [B], like each of ``reward_components``); observations are empty (a
        finished episode gets none) and there are no next stop strings. ``errors`` without a
        single failure is stored as ``[]``."""
        n = len(metadata)
        return cls(
            observations=[{"role": "user", "content": ""} for _ in range(n)],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.as_tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=list(answers),
            errors=list(errors) if any(e is not None for e in errors) else [],
            reward_components={
                name: torch.as_tensor(values, dtype=torch.float32) for name, values in (reward_components or {}).items()
            },
        )


class Environment(abc.ABC):
    """A batched, stateless-between-calls scorer; state travels in ``metadata``."""

    @abc.abstractmethod
    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        """Score (and for multi-turn tasks, answer) each log. Must return exactly B results."""

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """Environment-specific metrics over a finished batch (e.g. accuracy)."""
        return {}

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools the model may call in this environment's episodes, as JSON schemas in
        the OpenAI function format (``{"type": "function", "function": {"name", "description",
        "parameters"}}``). The rollout renders them into each prompt with the chat template's
        own tool support (``apply_chat_template(..., tools=...)``). Default: none."""
        return []

    def shutdown(self) -> None:
        """Free resources (worker pools, sandboxes)."""
