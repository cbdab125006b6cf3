"""The learning-rate schedule of ``policy.scheduler``, shared by policy backends: a factor
of the base learning rate per optimizer step (:func:`lr_factor`)."""

from __future__ import annotations

import math

import torch

from posttrain.config.schema import SchedulerConfig
from posttrain.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, cfg: SchedulerConfig) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Linear warmup reaches 1 at step ``warmup_steps - 1``; then ``constant`` stays at 1,
    ``linear`` and ``cosine`` decay to ``min_lr_ratio`` at step ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    horizon = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / horizon)
    if cfg.name == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def check_scheduler_config(cfg: SchedulerConfig) -> None:
    """Raise :class:`ConfigError` naming the ``policy.scheduler`` key that is wrong."""
    if cfg.name not in SCHEDULES:
        raise ConfigError(f"policy.scheduler.name: expected one of {', '.join(SCHEDULES)}, got '{cfg.name}'")
    if cfg.name != "constant" and cfg.total_steps is None:
        raise ConfigError(
            f"policy.scheduler.total_steps is needed by the '{cfg.name}' schedule (the step at which the "
            "decay ends); set it, or use policy.scheduler.name=constant"
        )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_factor`; step it once per optimizer step."""
    check_scheduler_config(cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
