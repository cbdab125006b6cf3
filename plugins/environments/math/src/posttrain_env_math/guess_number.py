"""The ``guess_number`` environment: a multi-turn game.

The model guesses a hidden integer; after each guess the environment answers "Higher." or
"Lower." as a user message, until the guess is right (reward 1.0) or ``max_guesses``
guesses are used (reward 0.0). A guess is written ``<guess>N</guess>``; the environment
asks the model to stop generating at ``</guess>`` (``next_stop_strings``). A reply without
a guess costs a turn and gets a reminder of the format.

Options (``environments.guess_number``): ``max_guesses`` (default 8).

Metadata per sample: ``target`` (int, required: a sample without an integer target is
reported as a per-sample error, not scored), ``low`` and ``high`` (the range told to the
model, default 1 and 100). The environment adds ``guesses`` (how many turns it has answered)
and ``solved``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain_env_math.math_env import last_assistant_text
from posttrain_env_math.options import GuessNumberOptions

STOP = "</guess>"
_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


def guess_number_prompt(low: int, high: int) -> list[Message]:
    """The opening message of a game over [low, high]."""
    return [{
        "role": "user",
        "content": f"I am thinking of an integer from {low} to {high}. Guess it: reply with <guess>N</guess>. "
        "I will tell you whether my number is higher or lower.",
    }]


def parse_guess(text: str) -> int | None:
    """The last ``<guess>N</guess>`` in ``text``, or ``None``."""
    found = _GUESS.findall(text)
    return int(found[-1]) if found else None


class GuessNumberEnvironment(Environment):
    def __init__(self, options: GuessNumberOptions):
        self.options = options

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        errors = [_metadata_problem(meta) for meta in metadata]
        results = [
            self._answer(last_assistant_text(log), meta) if error is None else ("", meta, 0.0, True)
            for log, meta, error in zip(message_logs, metadata, errors, strict=True)
        ]
        return EnvironmentReturn(
            observations=[{"role": "user", "content": reply} for reply, *_ in results],
            metadata=[meta for _, meta, _, _ in results],
            next_stop_strings=[None if done else [STOP] for *_, done in results],
            rewards=torch.tensor([reward for _, _, reward, _ in results], dtype=torch.float32),
            terminateds=torch.tensor([done for *_, done in results], dtype=torch.bool),
            answers=[str(parse_guess(last_assistant_text(log))) for log in message_logs],
            errors=errors if any(error is not None for error in errors) else [],
        )

    def _answer(self, reply: str, meta: Mapping[str, Any]) -> tuple[str, dict[str, Any], float, bool]:
        """``(observation, metadata, reward, terminated)`` for one sample."""
        target, low, high = int(meta["target"]), int(meta.get("low", 1)), int(meta.get("high", 100))
        guesses = int(meta.get("guesses", 0)) + 1
        guess = parse_guess(reply)
        solved = guess == target
        done = solved or guesses >= self.options.max_guesses
        state = {**meta, "guesses": guesses, "solved": solved}
        if done:
            return "", state, float(solved), True
        if guess is None:
            return f"Reply with <guess>N</guess>, N an integer from {low} to {high}.", state, 0.0, False
        return ("Higher." if target > guess else "Lower."), state, 0.0, False

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """``solved`` (fraction of games won) and ``mean_guesses`` (turns answered per game)."""
        if not metadata:
            return {}
        return {
            "solved": sum(bool(m.get("solved")) for m in metadata) / len(metadata),
            "mean_guesses": sum(int(m.get("guesses", 0)) for m in metadata) / len(metadata),
        }



def _metadata_problem(meta: Any) -> str | None:
    """Why a sample's metadata cannot be played, or None."""
    target = meta.get("target") if isinstance(meta, Mapping) else None
    try:
        int(target)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"the sample's metadata has no integer 'target' (the number to guess), found {target!r}"
    return None
