"""The outer training loop, written once for every algorithm.

An algorithm writes its steps (:class:`LoopSteps`: one training step, one validation pass)
and states its :class:`LoopPlan`; :class:`TrainingLoop` runs them the same way for all:

- resume: with ``checkpointing.resume`` and a checkpoint in ``checkpointing.dir``, the
  latest one restores the :class:`~posttrain.run.checkpoint.TrainingState` (policy, data
  loader position, driver random states), the step, and that step's metrics and last
  validation's (from ``training_info.json``); then :meth:`LoopSteps.start` runs;
- metric records: a run resumed from step N drops the records of later steps that a
  stopped run wrote after saving step N, and a fresh run those of earlier runs in its
  ``run_dir`` (:meth:`~posttrain.run.metrics.MetricLogger.rewind`): every step is on
  file once, as an uninterrupted run logs it;
- validation (phase ``validation``): before the first step when ``val_at_start`` (step 0,
  fresh runs only), every ``val_period`` steps, and after the last step when ``val_at_end``
  (unless that step was just validated or a stop was requested);
- training steps until ``total_steps``, each one's metrics logged (phase ``train``) and
  shown on the progress bar;
- data that runs out before ``total_steps`` (a step that takes a varying number of batches,
  as dynamic sampling does): the steps done are checkpointed, then :class:`RunEndedEarly`
  says after which step the run stopped and why (:meth:`LoopSteps.out_of_data`), without the
  end-of-run validation and export, so that the run exits non-zero instead of passing for
  a finished one;
- checkpoints: every ``checkpointing.save_period`` steps and after the last step run,
  scored by the step's metrics and the last validation's (``validation/<name>``);
- export: the policy's final weights as a Hugging Face folder (``export_dir``);
- stop: until the first validation or training step the run is starting up, and a stop
  signal ends it before any record or checkpoint is written (:mod:`posttrain.run.stop`);
  after SIGINT / SIGTERM
  (``context.stop_requested``) no new step starts; the last finished step is checkpointed
  and the loop returns without the end-of-run validation and the export;
- the end: once a run completed its plan (validation and export included) its last
  checkpoint is marked finished, with the plan. Started again with the same config, or the
  same plan, the run is over before any worker starts (:mod:`posttrain.run.finished`).
"""

from __future__ import annotations

import abc
from typing import Any

from posttrain.config import dump_config
from posttrain.errors import PosttrainError
from posttrain.run.checkpoint import TrainingState
from posttrain.run.context import RunContext
from posttrain.run.plan import LoopPlan


class RunEndedEarly(PosttrainError):
    """The training data ran out before the run's planned steps were done."""


class LoopSteps(abc.ABC):
    """What an algorithm does inside the loop. :meth:`train_step` is required; the others
    default to doing nothing."""

    def start(self, step: int) -> None:
        """Called once, after the checkpoint (if any) was restored and before the first
        validation or step; ``step`` is the step the run continues from (0: a fresh run)."""

    @abc.abstractmethod
    def train_step(self, step: int) -> dict[str, float] | None:
        """Run training step ``step`` (counted from 1) and return its metrics (the loop logs
        them), or None when the data ran out before the step could be filled (the loop ends
        there)."""

    def validate(self, step: int) -> dict[str, float] | None:
        """One validation pass after ``step`` steps; its metrics (the loop logs them), or
        None when the run has nothing to validate on."""
        return None

    def out_of_data(self, step: int) -> str:
        """Why the data ran out before step ``step`` could be filled, and the settings that
        let a run go further (after :meth:`train_step` returned None)."""
        return f"the training data ran out before step {step} could be filled"


class TrainingLoop:
    """One run of :class:`LoopSteps` under a :class:`LoopPlan` (see the module docstring).
    The caller builds the policy and what the steps use, and shuts them down after
    :meth:`run`."""

    def __init__(self, context: RunContext, plan: LoopPlan, steps: LoopSteps, state: TrainingState):
        self.context = context
        self.plan = plan
        self.steps = steps
        self.state = state
        self.step = 0
        self.metrics: dict[str, float] = {}  # the last training step's
        self.validation: dict[str, float] = {}  # the last validation's
        self.saved_step: int | None = None
        self.validated_step: int | None = None

    def run(self) -> dict[str, Any]:
        """Train (or resume) to the end of the plan; return the last step's metrics with
        ``"step"`` and the last validation's as ``validation/<name>``."""
        context, plan = self.context, self.plan
        save_period = context.config.checkpointing.save_period
        context.stop.check_startup()
        start = self.step = self.resume()
        context.stop.check_startup()
        self.steps.start(start)
        context.stop.check_startup()
        context.stop.begin_steps()
        context.metrics.rewind(start if start else None)
        if plan.val_at_start and self.step == 0:
            self.validate()
        bar = context.progress(plan.total_steps, plan.label, initial=self.step)
        ran_out = False
        try:
            while self.step < plan.total_steps and not context.stop_requested:
                metrics = self.steps.train_step(self.step + 1)
                if metrics is None:
                    ran_out = True
                    break
                self.step, self.metrics = self.step + 1, metrics
                context.log_metrics(self.step, metrics, "train")
                bar.update(metrics)
                if plan.val_period and self.step % plan.val_period == 0:
                    self.validate()
                if save_period and self.step % save_period == 0:
                    self.save()
        finally:
            bar.close()
        if ran_out:
            raise self.ended_early(start)
        if plan.val_at_end and self.validated_step != self.step and not context.stop_requested:
            self.validate()
        if self.step > start and self.saved_step != self.step:
            self.save()
        if plan.export_dir and not context.stop_requested:
            self.state.policy.export_hf(plan.export_dir)
            context.log.info("exported Hugging Face weights", path=plan.export_dir, step=self.step)
        if context.checkpoints is not None and self.saved_step == self.step and not context.stop_requested:
            context.checkpoints.update_info(self.step, {"finished": True, "plan": plan.record(), "length_keys": list(plan.length_keys)})
        return {"step": self.step, **self.metrics, **self._scored_validation()}

    def ended_early(self, start: int) -> RunEndedEarly:
        """Checkpoint the steps done (when any were), and the error saying why the run stopped."""
        if self.step > start and self.saved_step != self.step:
            self.save()
        saved = self.context.checkpoints.latest() if self.context.checkpoints is not None else None
        where = (f"the checkpoint {saved} holds step {self.step}; the run resumes from it when started again"
                 if saved is not None else "no checkpoint was saved")
        return RunEndedEarly(
            f"{self.plan.label} stopped after step {self.step} of {self.plan.total_steps}: "
            f"{self.steps.out_of_data(self.step + 1)}. Nothing was exported; {where}."
        )

    def validate(self) -> None:
        """Run the steps' validation after the current step and log it."""
        metrics = self.steps.validate(self.step)
        if metrics is None:
            return
        self.validation, self.validated_step = metrics, self.step
        self.context.log_metrics(self.step, metrics, "validation")

    def save(self) -> None:
        """Checkpoint the current step (no-op when checkpointing is off). ``config.yaml`` holds
        the config the run trains with: the schedule horizon filled in as the policy got it."""
        manager = self.context.checkpoints
        if manager is None:
            return
        config = self.context.config.with_schedule_horizon(self.plan.schedule_steps)
        info = {"validated_step": self.validated_step, "plan": self.plan.record()}
        manager.save(self.step, self.state.save, {**self.metrics, **self._scored_validation()}, dump_config(config), info)
        self.saved_step = self.step

    def resume(self) -> int:
        """Restore the latest checkpoint when resuming is on; return its step (0: a fresh run)."""
        folder = self.context.resume_checkpoint()
        if folder is None:
            return 0
        manager = self.context.checkpoints
        assert manager is not None
        info = manager.info(folder)
        self.state.load(folder, self.plan.label)
        for name, value in info.get("metrics", {}).items():
            if name.startswith("validation/"):
                self.validation[name.removeprefix("validation/")] = value
            else:
                self.metrics[name] = value
        self.validated_step = info.get("validated_step")
        step = self.saved_step = int(info["step"])
        self.context.log.info("resumed", algorithm=self.plan.label, checkpoint=str(folder), step=step, total_steps=self.plan.total_steps)
        return step

    def _scored_validation(self) -> dict[str, float]:
        return {f"validation/{name}": value for name, value in self.validation.items()}

