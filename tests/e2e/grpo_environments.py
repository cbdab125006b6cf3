"""A plugin module with an environment for GRPO runs in tests, registered in Ray actors
through ``GRPO(environment_plugins=[__name__])``.

``scripted``: single turn; each sample's reward is its metadata's ``reward`` (a number, or
the string ``"nan"``), whatever the model answered, or with ``"spread"`` the number of
distinct characters of the response over 10 (rewards that differ within a group); a sample
whose metadata has an ``error`` is reported as failed (``EnvironmentReturn.errors``). It
lets a test choose a step's rewards and failures through the data, e.g. poison the third
step with NaN.

``mortal``: single turn; rewards as ``scripted``'s ``"spread"``. When the first sample's
metadata has ``counter`` (a file) and ``die_at_call`` (n), the n-th call of the run,
counted in that file across processes, kills the process it runs in with SIGKILL before
answering: an environment actor killed in the middle of a step.

``delayed``: single turn; reward 1 when the response contains the metadata's ``answer``, 0
otherwise, given after a random wait of up to the metadata's ``max_delay_s`` seconds per
call: an environment with latency (a remote reward, code execution, an agent), whose random
delays shift when each step's rollout finishes.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain import hookimpl
from posttrain.interfaces import Environment, EnvironmentReturn


class Scripted(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        rewards = [spread(log) if meta["reward"] == "spread" else float(meta["reward"])
                   for log, meta in zip(message_logs, metadata, strict=True)]
        return EnvironmentReturn.final(rewards, metadata, errors=[meta.get("error") for meta in metadata])


def spread(message_log: Sequence[Any]) -> float:
    """The number of distinct characters of the last message over 10."""
    return len(set(message_log[-1]["content"])) / 10


class Mortal(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        if "counter" in metadata[0]:
            counter = Path(metadata[0]["counter"])
            calls = int(counter.read_text()) + 1 if counter.exists() else 1
            counter.write_text(str(calls))
            if calls == int(metadata[0]["die_at_call"]):
                os.kill(os.getpid(), signal.SIGKILL)
        return EnvironmentReturn.final([spread(log) for log in message_logs], metadata)


class Delayed(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        time.sleep(random.uniform(0, max(float(meta.get("max_delay_s", 0)) for meta in metadata)))
        rewards = [float(str(meta["answer"]) in log[-1]["content"]) for log, meta in zip(message_logs, metadata, strict=True)]
        return EnvironmentReturn.final(rewards, metadata)


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {"scripted": lambda options: Scripted(), "delayed": lambda options: Delayed(), "mortal": lambda options: Mortal()}
