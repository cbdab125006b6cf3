"""Hook implementations of posttrain-grpo.

Every Ray worker loads this module, so it imports nothing heavy: the algorithm and the loss
(torch) are imported by their factories when a run builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config.schema import RunConfig
from posttrain.plugins import plugin_host
from posttrain_grpo.config import ClippedPGConfig, GRPOConfig
from posttrain_grpo.validation import validate_run_config

if TYPE_CHECKING:
    from posttrain_grpo.algorithm import GRPO
    from posttrain_grpo.loss import ClippedPGLoss


def clipped_pg_loss(options: ClippedPGConfig) -> ClippedPGLoss:
    """Factory of the ``clipped_pg`` loss (``options``: ``grpo.loss``)."""
    from posttrain_grpo.loss import ClippedPGLoss

    return ClippedPGLoss(options)


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"grpo": GRPOConfig}


def grpo_algorithm() -> GRPO:
    """Factory of the ``grpo`` algorithm."""
    from posttrain_grpo.algorithm import GRPO

    return GRPO()


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"grpo": grpo_algorithm}


@hookimpl
def posttrain_losses() -> Mapping[str, Any]:
    return {"clipped_pg": clipped_pg_loss}


@hookimpl
def posttrain_validate_config(config: RunConfig) -> None:
    validate_run_config(config, plugin_host())
