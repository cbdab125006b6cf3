"""The worker the conformance kit starts to use a plugin by name inside a Ray worker."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.distributed.worker_group import Worker
from posttrain.interfaces.environment import EnvironmentReturn, Message
from posttrain.plugins import plugin_host


class ContractProbe(Worker):
    """Builds registered components from this process's own plugin host (entry points)."""

    def pid(self) -> int:
        return os.getpid()

    def step_environment(
        self, name: str, options: Mapping[str, Any], message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]
    ) -> EnvironmentReturn:
        environment = plugin_host().environments[name](options)
        try:
            return environment.step(message_logs, metadata)
        finally:
            environment.shutdown()
