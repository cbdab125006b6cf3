"""Algorithms: what ``posttrain run NAME`` runs (GRPO, SFT, DPO, ...)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.run import RunContext


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
        return the final metrics. ``context`` builds backends, logs metrics and saves
        checkpoints."""
