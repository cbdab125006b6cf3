"""Algorithms: what ``posttrain run NAME`` runs (GRPO, SFT, DPO, ...)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.interfaces.context import RunContext


class Algorithm(abc.ABC):
    """A training recipe written against interfaces only.

    ``config_section`` names the section (contributed through the
    ``posttrain_config_sections`` hook) holding the algorithm's own options.
    """

    name: str = ""
    config_section: str | None = None

    @abc.abstractmethod
    def run(self, context: RunContext) -> dict[str, Any]:
        """Run to completion (resuming from the latest checkpoint when there is one) and
        return the final metrics (with ``"step"``, the last finished step). ``context``
        builds backends, logs metrics and saves checkpoints.

        Check ``context.stop_requested`` before each step: once it is set (SIGINT /
        SIGTERM), start no new step, checkpoint the last finished one and return."""
