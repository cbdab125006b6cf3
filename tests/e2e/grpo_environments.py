"""A plugin module with an environment for GRPO runs in tests, registered in Ray actors
through ``GRPO(environment_plugins=[__name__])``.

``scripted``: single turn; each sample's reward is its metadata's ``reward`` (a number, or
the string ``"nan"``), whatever the model answered, and a sample whose metadata has an
``error`` is reported as failed (``EnvironmentReturn.errors``). It lets a test choose a
step's rewards and failures through the data, e.g. poison the third step with NaN.

``delayed``: single turn; reward 1 when the response contains the metadata's ``answer``, 0
otherwise, given after a random wait of up to the metadata's ``max_delay_s`` seconds per
call: an environment with latency (a remote reward, code execution, an agent), whose random
delays shift when each step's rollout finishes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain import hookimpl
from posttrain.interfaces import Environment, EnvironmentReturn


class Scripted(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        return EnvironmentReturn.final([float(meta["reward"]) for meta in metadata], metadata,
                                       errors=[meta.get("error") for meta in metadata])


class Delayed(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        time.sleep(random.uniform(0, max(float(meta.get("max_delay_s", 0)) for meta in metadata)))
        rewards = [float(str(meta["answer"]) in log[-1]["content"]) for log, meta in zip(message_logs, metadata, strict=True)]
        return EnvironmentReturn.final(rewards, metadata)


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {"scripted": lambda options: Scripted(), "delayed": lambda options: Delayed()}
