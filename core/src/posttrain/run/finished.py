"""A run started again after it finished: said so, and nothing started.

When a run completes its plan (the end-of-run validation and the export included), the loop
marks its last checkpoint finished, with the plan (:class:`~posttrain.run.plan.LoopPlan`) and
the config keys that set its length. Started again with resuming on, the run has nothing left
to do when that checkpoint is the one it would resume from and

- its ``config.yaml`` is the run's config (the schedule horizon it filled in aside):
  :func:`finished_unchanged`, which :func:`~posttrain.run.context.run_algorithm` checks
  before reading data or starting Ray; or
- the algorithm's plan, read from the data, is the same (a config that changed only what does
  not decide the remaining work, e.g. ``logger.*``): :func:`finished_run`, which an
  algorithm calls with its plan before it builds any worker.

Either logs one line naming the checkpoint and how to train longer or start over, and gives
back the step and the final metrics, as the finished run returned them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.config import dump_config

if TYPE_CHECKING:
    from posttrain.interfaces.context import RunContext
    from posttrain.run.plan import LoopPlan


def finished_unchanged(context: RunContext) -> dict[str, Any] | None:
    """The finished run's result when the checkpoint it would resume from is marked finished
    and was written by this very config; None otherwise."""
    import yaml


    found = _finished_checkpoint(context)
    if found is None:
        return None
    folder, info = found
    saved_file = folder / "config.yaml"
    if not saved_file.is_file():
        return None
    saved = yaml.safe_load(saved_file.read_text()) or {}
    horizon = ((saved.get("policy") or {}).get("scheduler") or {}).get("total_steps")
    current = context.config if not isinstance(horizon, int) else context.config.with_schedule_horizon(horizon)
    if yaml.safe_load(dump_config(current)) != saved:
        return None
    return _announce(context, folder, info)


def finished_run(context: RunContext, plan: LoopPlan) -> dict[str, Any] | None:
    """The finished run's result when the checkpoint it would resume from is marked finished
    with this very plan (same steps, end-of-run validation and export); None otherwise."""
    found = _finished_checkpoint(context)
    if found is None or found[1].get("plan") != plan.record():
        return None
    return _announce(context, *found)


def _finished_checkpoint(context: RunContext) -> tuple[Path, dict[str, Any]] | None:
    folder = context.resume_checkpoint()
    if folder is None or context.checkpoints is None:
        return None
    info = context.checkpoints.info(folder)
    return (folder, info) if info.get("finished") else None


def _announce(context: RunContext, folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    step = int(info["step"])
    keys = info.get("length_keys") or []
    longer = f"raise {' or '.join(keys)}" if keys else "plan more steps"
    context.log.info(
        f"the run already finished: it completed at step {step} (checkpoint {folder}), so there is nothing to do. "
        f"To train longer, {longer}; to start over, set checkpointing.resume=false or use another run_dir"
    )
    return {"step": step, **info.get("metrics", {})}
