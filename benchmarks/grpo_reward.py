"""The GRPO benchmark's reward, as a posttrain environment plugin that TRL's reward function calls too.

``bench_reward`` scores a completion by the share of its characters that are vowels
(``aeiou``): a number in [0, 1] that varies between the samples of a prompt group even on a
randomly initialised model, so no group has all-equal rewards, every advantage is non-zero
in general, and neither framework can skip work because a group carries no signal.

It is declared light (:func:`~posttrain.config.environments.runs_in_driver`, as ``math``
is), so posttrain calls it in the run's driver process, as TRL calls its reward function.
The benchmark makes this module an installed plugin of its child processes only
(:func:`install_plugin`: a ``.dist-info`` folder with the ``posttrain`` entry point on
``PYTHONPATH``, inherited by Ray's workers), so the run finds it exactly as it finds a
pip-installed environment. With the ``record`` option (a
file path) every ``step`` call appends one JSON line: the prompts (user messages), the
completion lengths in generated tokens (from the assistant message's ``token_ids``) and the
rewards of the batch it scored. TRL's side calls :func:`vowel_share` through
:class:`BenchRewardEnvironment` as well.

For workloads whose rollouts wait rather than compute (agents, code execution, remote
rewards), ``latency_s`` makes every ``step`` call wait that many seconds first, and
``turns`` makes an episode last that many assistant turns: the environment answers "Go on."
until the last, which is scored on its own text and recorded with the generated tokens of
every turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain import hookimpl
from posttrain.config.environments import runs_in_driver
from posttrain.interfaces import Environment, EnvironmentReturn

NAME = "bench_reward"
MODULE = __name__
VOWELS = frozenset("aeiou")


def vowel_share(text: str) -> float:
    """Share of ``text``'s characters that are lowercase vowels; 0.0 for an empty text."""
    return sum(ch in VOWELS for ch in text) / len(text) if text else 0.0


class BenchRewardEnvironment(Environment):
    """Single turn; reward = :func:`vowel_share` of the last assistant message; every episode ends."""

    def __init__(self, record: str | None = None, latency_s: float = 0.0, turns: int = 1):
        self.record = Path(record) if record else None
        self.latency_s = float(latency_s)
        self.turns = int(turns)

    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        time.sleep(self.latency_s)
        if len(_all(message_logs[0], "assistant")) < self.turns:  # every log of a call is at the same turn
            n = len(message_logs)
            return EnvironmentReturn(
                observations=[{"role": "user", "content": "Go on."}] * n, metadata=list(metadata),
                next_stop_strings=[None] * n, rewards=torch.zeros(n), terminateds=torch.zeros(n, dtype=torch.bool),
            )
        answers = [_last(log, "assistant") for log in message_logs]
        rewards = [vowel_share(a["content"] if a else "") for a in answers]
        if self.record is not None:
            prompts = [_all(log, "user")[0].get("content", "") for log in message_logs]
            lengths = [sum(len(a["token_ids"]) if "token_ids" in a else -1 for a in _all(log, "assistant"))
                       for log in message_logs]
            with self.record.open("a") as f:
                f.write(json.dumps({"prompts": prompts, "completion_lengths": lengths, "rewards": rewards}) + "\n")
        return EnvironmentReturn.final(rewards, metadata)


def _last(log: Sequence[Any], role: str) -> Any:
    return next((m for m in reversed(log) if m.get("role") == role), None)


def _all(log: Sequence[Any], role: str) -> list[Any]:
    return [m for m in log if m.get("role") == role]


@runs_in_driver  # counts vowels
def bench_reward_environment(options: Mapping[str, Any]) -> BenchRewardEnvironment:
    return BenchRewardEnvironment(**dict(options))


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {NAME: bench_reward_environment}


def install_plugin(folder: Path) -> Path:
    """Write a ``.dist-info`` under ``folder`` that declares this module as the installed
    posttrain plugin ``posttrain-bench-reward``; return ``folder`` (to put on ``PYTHONPATH``,
    together with this module's folder)."""
    info = folder / "posttrain_bench_reward-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posttrain-bench-reward\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[posttrain]\n{NAME} = {MODULE}\n")
    return folder
