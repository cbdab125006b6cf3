"""The ``distill`` algorithm (``posttrain run distill``): on-policy distillation, run by core's
:class:`~posttrain.run.loop.TrainingLoop`.

One step, as data::

    prompts (distill.num_prompts_per_step, from the resumable data loader)
      -> x distill.num_generations_per_prompt -> rollout of the student: generation backend +
         environments (their rewards are logged, not trained on)
      -> data plane partition "train/<step>"
      -> teacher (its own worker group, eval mode): its top-k token ids at every position of
         the student's sequences and their logprobs -> the partition (written by the
         teacher's workers when they can reach the plane, through the driver otherwise)
      -> student: policy.train(distillation loss), one optimizer step per
         policy.train_global_batch_size samples; the student's logprobs of the teacher's
         top-k ids are computed in its workers, so no [tokens, vocabulary] tensor leaves a worker
      -> refit the generation backend -> clear the partition
      -> metrics -> validation (greedy, as GRPO's) -> checkpoints (the student; the teacher is
         frozen and needs none)

Synchronous: each step generates with the weights of the step before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from posttrain.data import dataloader_from_config, dataset_from_config, encoder_from_config, require_dataset
from posttrain.errors import ConfigError
from posttrain.interfaces import Algorithm, PlaneSamples
from posttrain.run.checkpoint import TrainingState
from posttrain.run.context import RunContext
from posttrain.run.environments import environment_names, shutdown_environments
from posttrain.run.finished import finished_run
from posttrain.run.loop import LoopPlan, LoopSteps, TrainingLoop
from posttrain.run.metrics import StageTimer, combine_train_passes
from posttrain.run.prompt_rollout import PromptRollout, validate_greedy
from posttrain.run.refit import refit
from posttrain_distill.config import DistillConfig
from posttrain_distill.loss import DistillationLoss
from posttrain_distill.teacher import check_teacher
from posttrain_grpo.prompts import PromptStream
from posttrain_grpo.step import TrainingDiverged, first_nonfinite, rollout_summary, sample_keys, step_seed

#: What the teacher's top-k pass reads.
SEQUENCE_FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
#: What the teacher's top-k pass writes into the partition: {plane field: its result field}.
TEACHER_FIELDS = {"topk_indices": "topk_indices", "teacher_topk_logprobs": "topk_logprobs"}
#: What the student's training pass reads.
TRAIN_FIELDS = (*SEQUENCE_FIELDS, "topk_indices", "teacher_topk_logprobs")


class Distill(Algorithm):
    """On-policy distillation (options: the ``distill`` config section).

    ``environment_plugins`` are importable plugin modules that register environments not
    installed as distributions; they are registered in every environment actor.
    """

    name = "distill"
    config_section = "distill"

    def __init__(self, environment_plugins: Sequence[str] = ()):
        self.environment_plugins = tuple(environment_plugins)

    def run(self, context: RunContext) -> dict[str, Any]:
        run = DistillRun(context, self.environment_plugins)
        finished = finished_run(context, run.plan)
        if finished is not None:
            return finished
        with contextlib.ExitStack() as cleanup:
            run.start_services(cleanup)
            return TrainingLoop(context, run.plan, run, TrainingState(run.student, run.prompts)).run()


class DistillRun(LoopSteps):
    """One run's data, plan and steps; :meth:`start_services` starts the workers."""

    def __init__(self, ctx: RunContext, environment_plugins: Sequence[str]):
        self.ctx = ctx
        self.config = config = ctx.config
        self.options: DistillConfig = config.section("distill")
        self.environment_plugins = environment_plugins
        check_teacher(config)  # before data is read or any worker starts
        encoder = encoder_from_config(config)
        if encoder.images is not None:
            raise ConfigError(
                f"policy.model: '{config.policy.model}' is a vision-language model; distillation does not yet give its "
                "teacher and student the images of their rows. Distil a text model, or train this one with sft or grpo"
            )
        self.tokenizer, self.chat_template = encoder.tokenizer, encoder.template
        train_set = require_dataset(config, "train", "prompt", encoder)
        val_set = dataset_from_config(config, "validation", "prompt", encoder)
        self.environment_names, self.default_task = environment_names(
            config, [train_set, val_set], plugins=environment_plugins
        )
        options = self.options
        self.prompts = PromptStream(dataloader_from_config(config, train_set, options.num_prompts_per_step),
                                    options.max_num_epochs)
        if val_set is None:
            self.val_prompts = None
        else:
            count = len(val_set) if options.max_val_samples is None else min(options.max_val_samples, len(val_set))
            self.val_prompts = val_set.collate(range(count))
        total_steps = min(options.max_num_steps, self.prompts.total_batches)
        self.plan = LoopPlan(
            label="distill",
            total_steps=total_steps,
            schedule_steps=total_steps * max(1, options.samples_per_step // config.policy.train_global_batch_size),
            val_period=options.val_period,
            val_at_start=options.val_at_start,
            export_dir=options.export_dir,
            length_keys=("distill.max_num_steps", "distill.max_num_epochs"),
        )
        self.loss_fn = DistillationLoss(options.kl, options.forward_weight)

    def start_services(self, cleanup: contextlib.ExitStack) -> None:
        """Start the environments, the student, the teacher, the generation backend and the
        data plane, all at once; ``cleanup`` shuts them down."""
        ctx = self.ctx
        ctx.start_cluster()
        startup = ctx.startup(cleanup)
        environments = startup.start(
            "environments", lambda: ctx.build_environments(self.environment_names, plugins=self.environment_plugins),
            shutdown_environments,
        )
        student = startup.start("policy", lambda: ctx.build_policy(schedule_steps=self.plan.schedule_steps, reference=False))
        teacher = startup.start("teacher", lambda: ctx.build_policy(policy=self.options.teacher, name="teacher", reference=False))
        rows = max(self.options.samples_per_step, 0 if self.val_prompts is None else len(self.val_prompts))
        sized = self.config.generation.with_rows_per_call(rows)
        generation = startup.start("generation", lambda: ctx.build_generation(sized, host=student))
        plane = startup.start("data_plane", ctx.build_data_plane)
        startup.wait()
        self.student, self.teacher, self.plane = student.value, teacher.value, plane.value
        self.generation = generation.value
        self.rollout = PromptRollout(
            self.generation, environments.value, self.tokenizer, self.config.policy.max_total_sequence_length,
            self.options.max_rollout_turns, self.chat_template, self.default_task,
        )

    # ------------------------------------------------------------------ the loop's steps

    def start(self, step: int) -> None:
        """A resumed run refits the generation backend to the restored student; a colocated
        student gives its devices to generation until it trains."""
        if step:
            refit(self.student, self.generation, self.config.generation.refit_bucket_bytes, version=step)
        if self.config.generation.colocated:
            self.student.offload()

    def train_step(self, step: int) -> dict[str, float] | None:
        """One distillation step; None when the prompts ran out."""
        timer = StageTimer()
        with timer("step"):
            prompts = self.prompts.next()
            if prompts is None:
                return None
            with timer("rollout"):
                self.generation.set_sampling_seed(step_seed(self.config.seed, "train", step))
                self.generation.prepare_for_generation()
                try:
                    batch, rollout_metrics = self.rollout(prompts, greedy=False,
                                                          repeats=self.options.num_generations_per_prompt)
                finally:
                    self.generation.finish_generation()
            self.prompts.trained(self.prompts.position())
            partition = f"train/{step}"
            keys = sample_keys(len(prompts), self.options.num_generations_per_prompt)
            self.plane.put(partition, keys, batch.fields(SEQUENCE_FIELDS))
            try:
                with timer("teacher"):
                    self.teacher.topk_into(PlaneSamples(self.plane, partition, keys, SEQUENCE_FIELDS), self.options.topk,
                                           TEACHER_FIELDS)
                with timer("training"):
                    if self.config.generation.colocated:
                        self.student.prepare_for_training()
                    train_metrics = self.optimize(step, PlaneSamples(self.plane, partition, keys, TRAIN_FIELDS))
                with timer("refit"):
                    stats = refit(self.student, self.generation, self.config.generation.refit_bucket_bytes, version=step)
                    if self.config.generation.colocated:
                        self.student.offload()
            finally:
                self.plane.clear(partition)
        return {
            **rollout_summary([(batch, rollout_metrics)]),
            **train_metrics,
            "refit/seconds": stats.seconds,
            **timer.metrics(),
        }

    def optimize(self, step: int, samples: PlaneSamples) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` samples; a non-finite
        loss or gradient norm stops the run (:class:`TrainingDiverged`)."""
        parts = []
        for chunk in samples.chunks(self.config.policy.train_global_batch_size):
            metrics = self.student.train_from(chunk, self.loss_fn)
            bad = first_nonfinite(metrics, ("loss", "grad_norm"))
            if bad is not None:
                raise TrainingDiverged(f"distill step {step}: the training metric '{bad}' is {metrics[bad]}; the run "
                                       "stops without saving. Lower policy.optimizer.lr or set policy.max_grad_norm")
            parts.append(metrics)
        return combine_train_passes(parts, self.loss_fn.metric_reductions)

    def validate(self, step: int) -> dict[str, float] | None:
        """Greedy rollouts of the validation prompts, as GRPO's validation: ``accuracy`` (the
        mean environment reward), the mean response length and the rollout metrics."""
        if self.val_prompts is None:
            return None
        timer = StageTimer()
        with timer("validation"):
            metrics = validate_greedy(self.val_prompts, self.rollout, self.generation,
                                      step_seed(self.config.seed, "validation", step))
        return {**metrics, **timer.metrics()}
