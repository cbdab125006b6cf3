"""A plugin module with an environment for GRPO runs in tests, registered in Ray actors
through ``GRPO(environment_plugins=[__name__])``.

``scripted``: single turn; each sample's reward is its metadata's ``reward`` (a number, or
the string ``"nan"``), whatever the model answered, and a sample whose metadata has an
``error`` is reported as failed (``EnvironmentReturn.errors``). It lets a test choose a
step's rewards and failures through the data, e.g. poison the third step with NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain import hookimpl
from posttrain.interfaces import Environment, EnvironmentReturn


class Scripted(Environment):
    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        return EnvironmentReturn.final([float(meta["reward"]) for meta in metadata], metadata,
                                       errors=[meta.get("error") for meta in metadata])


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {"scripted": lambda options: Scripted()}
