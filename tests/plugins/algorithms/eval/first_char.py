"""A plugin module with an environment for ``eval`` runs in tests, registered in Ray actors
through ``Eval(environment_plugins=[__name__])``.

``first_char``: single turn; the answer is the first character of the response (None when it
is empty) and the reward is 1 when that character is in the metadata's ``accept`` string:
with a random tiny model about as often as ``accept`` is long over the vocabulary, so
completions of one prompt disagree and pass@k, maj@k have something to count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain import hookimpl
from posttrain.interfaces import Environment, EnvironmentReturn


class FirstChar(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        answers = [log[-1]["content"][:1] or None for log in message_logs]
        rewards = [float(a is not None and a in meta["accept"]) for a, meta in zip(answers, metadata, strict=True)]
        return EnvironmentReturn.final(rewards, metadata, answers=answers)


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {"first_char": lambda options: FirstChar()}
