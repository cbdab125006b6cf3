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


class WeightProbe(Worker):
    """A stand-in generation engine for weight-sync checks: it joins the sync group like
    an engine and keeps a copy of every tensor it receives, with the version."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, Any] = {}
        self.version = -1
        self.receiver: Any = None

    def init_weight_transfer(self, init: Any) -> None:
        from posttrain.backend.weight_sync import BroadcastReceiver

        self.receiver = BroadcastReceiver(init)

    def receive_weights(self, version: int) -> list[str]:
        self.receiver.receive(lambda bucket: self.received.update({name: t.clone() for name, t in bucket}))
        self.version = version
        return []

    def state(self) -> tuple[int, dict[str, Any]]:
        return self.version, self.received
