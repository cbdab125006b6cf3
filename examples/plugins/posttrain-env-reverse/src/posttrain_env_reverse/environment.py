"""The ``reverse`` environment: the answer must be the sample's text reversed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.errors import DataError
from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain_env_reverse.options import ReverseOptions


class ReverseEnvironment(Environment):
    """Single turn. Reward 1.0 when the last assistant message, stripped of surrounding
    whitespace, equals ``metadata["text"][::-1]`` (in any case with ``ignore_case``), else
    0.0; every episode ends."""

    def __init__(self, options: ReverseOptions | None = None):
        self.options = options or ReverseOptions()

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise DataError(f"reverse: {len(message_logs)} message logs but {len(metadata)} metadata entries")
        answers = [_last_assistant(log) for log in message_logs]
        targets = [_target(i, meta)[::-1] for i, meta in enumerate(metadata)]
        rewards = [float(a is not None and self._same(a.strip(), t)) for a, t in zip(answers, targets, strict=True)]
        return EnvironmentReturn.final(rewards, metadata, answers=answers)

    def _same(self, answer: str, target: str) -> bool:
        return answer.casefold() == target.casefold() if self.options.ignore_case else answer == target

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        return {"accuracy": float(rewards.float().mean()) if len(rewards) else 0.0}


def _last_assistant(log: Sequence[Message]) -> str | None:
    for message in reversed(log):
        if message.get("role") == "assistant":
            return message.get("content", "")
    return None


def _target(index: int, meta: Any) -> str:
    if not isinstance(meta, Mapping) or not isinstance(meta.get("text"), str):
        raise DataError(f"reverse: sample {index} needs metadata {{'text': str}}, got {meta!r}")
    return meta["text"]
