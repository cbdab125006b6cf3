"""A plugin module of environments that misbehave on purpose, for containment tests.

``flaky`` reads the last message of each log: "raise" makes the whole call raise,
"short" makes it return one reward too few, "sleep" makes it hang, "nap" sleeps ``nap_s``
seconds, "bad" fails that sample
alone (``EnvironmentReturn.errors``), "die" kills the process it runs in with SIGKILL the
first time it is seen (the file ``options["died_marker"]`` remembers it across processes);
anything else scores ``options["reward"]``. Option ``built_marker`` is a file path ``flaky``
writes when it is built, ``shutdown_marker`` one it appends a line to at each shutdown. ``broken``
fails to build. Registered in Ray actors through
``plugins=[__name__]``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain import hookimpl
from posttrain.errors import ConfigError
from posttrain.interfaces import Environment, EnvironmentReturn


class Flaky(Environment):
    def __init__(self, reward: float = 1.0, built_marker: str | None = None, died_marker: str | None = None,
                 shutdown_marker: str | None = None, nap_s: float = 0.0):
        self.reward = reward
        self.died_marker = Path(died_marker) if died_marker else None
        self.shutdown_marker = Path(shutdown_marker) if shutdown_marker else None
        self.nap_s = nap_s
        if built_marker:
            Path(built_marker).write_text("built")

    def shutdown(self) -> None:
        if self.shutdown_marker is not None:
            with self.shutdown_marker.open("a") as marker:
                marker.write("shut down\n")

    def step(self, message_logs: Sequence[Sequence[Any]], metadata: Sequence[Any]) -> EnvironmentReturn:
        says = [log[-1]["content"] for log in message_logs]
        if "die" in says and self.died_marker is not None and not self.died_marker.exists():
            self.died_marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if "raise" in says:
            raise RuntimeError("asked to raise")
        if "sleep" in says:
            time.sleep(120)
        if "nap" in says:
            time.sleep(self.nap_s)
        n = len(message_logs) - ("short" in says)
        return EnvironmentReturn(
            observations=[{"role": "user", "content": "ok"} for _ in range(n)],
            metadata=[{**meta, "seen": said} for meta, said in zip(metadata, says, strict=False)][:n],
            next_stop_strings=[None] * n,
            rewards=torch.full((n,), self.reward),
            terminateds=torch.zeros(n, dtype=torch.bool),
            errors=[f"cannot score {said!r}" if said == "bad" else None for said in says][:n],
        )

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        return {"total": float(rewards.sum())}


def build_flaky(options: Mapping[str, Any]) -> Flaky:
    return Flaky(**options)


def build_broken(options: Mapping[str, Any]) -> Environment:
    raise ConfigError("environments.broken.mode: expected 'on', found 'off'")


@hookimpl
def posttrain_environments() -> Mapping[str, Any]:
    return {"flaky": build_flaky, "broken": build_broken}
