"""GRPO (``posttrain run grpo``): its steps, written once, against the interfaces only, run
by core's :class:`~posttrain.run.loop.TrainingLoop`.

One step, as data::

    prompts (grpo.num_prompts_per_step, from the resumable data loader)
      -> x grpo.num_generations_per_prompt -> rollout: generation backend + environments,
         up to grpo.max_rollout_turns turns
      -> rewards scaled and length-shaped -> group advantages -> overlong filtering
      -> data plane partition "train/<step>", each sample tagged with its signal reward
      -> dynamic sampling: more rollouts until the step holds enough informative groups,
         decided from the tags alone (dropped groups are never fetched)
      -> every pass below reads the kept samples' inputs from the partition
      -> previous logprobs (only with several optimizer steps per batch: on policy the
         training pass's own, detached) and reference logprobs when grpo.loss.kl_penalty > 0
      -> policy.train(clipped_pg), one optimizer step per policy.train_global_batch_size
      -> refit the generation backend -> clear the partition
      -> metrics -> validation every grpo.val_period steps -> checkpoint every
         checkpointing.save_period steps and at the end

Stop, resume, validation and checkpoint periods, the export: core's loop (see
:mod:`posttrain.run.loop`). A resumed run restores the policy (weights, optimizer,
scheduler), the data loader position and the driver's random states from the latest
checkpoint, refits the generation backend, and continues with the next step. Sampling does not depend on the process: before each step the
generation backend is reseeded from ``(seed, step)`` (:func:`~posttrain_grpo.step.step_seed`),
so a resumed run samples exactly what an uninterrupted run would.

A non-finite loss or gradient norm stops the run with :class:`~posttrain_grpo.step.TrainingDiverged`
naming the step and the metric; no checkpoint is written after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.batch import Batch
from posttrain.config import where_set
from posttrain.data import (
    TokenizedDataset,
    dataloader_from_config,
    dataset_from_config,
    encoder_from_config,
    require_dataset,
)
from posttrain.errors import ConfigError
from posttrain.interfaces import Algorithm, DataPlane, Environment, Generation, PlaneSamples, Policy
from posttrain.run.checkpoint import TrainingState
from posttrain.run.context import RunContext
from posttrain.run.environments import host_with
from posttrain.run.finished import finished_run
from posttrain.run.loop import LoopPlan, LoopSteps, TrainingLoop
from posttrain.run.metrics import combine_train_passes
from posttrain.run.refit import refit
from posttrain.run.rollout import run_rollout
from posttrain_grpo.config import GRPOConfig
from posttrain_grpo.dynamic_sampling import DynamicSampler
from posttrain_grpo.prompts import PromptStream
from posttrain_grpo.step import (
    LOGPROB_FIELDS,
    METRIC_FIELDS,
    ROLLOUT_FIELDS,
    SIGNAL_TAG,
    TRAIN_FIELDS,
    StageTimer,
    TrainingDiverged,
    batch_metrics,
    first_nonfinite,
    nonfinite_fields,
    rollout_summary,
    sample_keys,
    score,
    step_seed,
    throughput,
)

#: Per-sample fields of a prompt batch that the rollout reads.
PROMPT_FIELDS = ("messages", "task", "metadata", "answer")


class GRPO(Algorithm):
    """Group relative policy optimisation (options: the ``grpo`` config section).

    ``environment_plugins`` are importable plugin modules that register environments not
    installed as distributions (a project's own, or a test's); they are registered in every
    environment actor, next to the installed plugins.
    """

    name = "grpo"
    config_section = "grpo"

    def __init__(self, environment_plugins: Sequence[str] = ()):
        self.environment_plugins = tuple(environment_plugins)

    def run(self, context: RunContext) -> dict[str, Any]:
        run = GRPORun(context, self.environment_plugins)
        finished = finished_run(context, run.plan)
        if finished is not None:
            return finished
        with contextlib.ExitStack() as cleanup:
            run.start_services(cleanup)
            return TrainingLoop(context, run.plan, run, TrainingState(run.policy, run.prompts.loader)).run()


class GRPORun(LoopSteps):
    """One run's data, plan and steps. The constructor reads the data and fixes the plan;
    :meth:`start_services` starts the workers, engines, environments and data plane the steps use."""

    def __init__(self, ctx: RunContext, environment_plugins: Sequence[str]):
        self.ctx = ctx
        self.environment_plugins = tuple(environment_plugins)
        self.config = config = ctx.config
        self.grpo: GRPOConfig = config.section("grpo")
        encoder = encoder_from_config(config)
        self.tokenizer, self.chat_template = encoder.tokenizer, encoder.template
        train_set = require_dataset(config, "train", "prompt", encoder)
        val_set = dataset_from_config(config, "validation", "prompt", encoder)
        names, self.default_task = environment_names(config, [train_set, val_set], plugins=environment_plugins)
        self.environment_names = names
        self.prompts = PromptStream(
            dataloader_from_config(config, train_set, self.grpo.num_prompts_per_step), self.grpo.max_num_epochs
        )
        self.val_prompts = _validation_prompts(val_set, self.grpo.max_val_samples) if val_set is not None else None
        total_steps = min(self.grpo.max_num_steps, self.prompts.total_batches)
        updates_per_step = max(1, self.grpo.samples_per_step // config.policy.train_global_batch_size)
        self.plan = LoopPlan(
            label="GRPO",
            total_steps=total_steps,
            schedule_steps=total_steps * updates_per_step,
            val_period=self.grpo.val_period,
            val_at_start=self.grpo.val_at_start,
            export_dir=self.grpo.export_dir,
            length_keys=("grpo.max_num_steps", "grpo.max_num_epochs"),
        )
        self.loss_fn = ctx.build_loss("clipped_pg", self.grpo.loss)
        self.needs_reference = self.grpo.loss.kl_penalty > 0 or not self.grpo.skip_reference_logprobs_when_kl_off
        self.needs_prev = updates_per_step > 1 or not self.grpo.skip_prev_logprobs_when_on_policy
        self.colocated = config.generation.colocated

    def start_services(self, cleanup: contextlib.ExitStack) -> None:
        """Start the environments, the policy, the generation backend and the data plane, all
        at once (:meth:`RunContext.startup`); ``cleanup`` shuts them down."""
        ctx = self.ctx
        ctx.start_cluster()
        startup = ctx.startup(cleanup)
        environments = startup.start(
            "environments", lambda: ctx.build_environments(self.environment_names, plugins=self.environment_plugins),
            _shutdown_environments,
        )
        policy = startup.start("policy", lambda: ctx.build_policy(schedule_steps=self.plan.schedule_steps))
        generation = startup.start("generation", ctx.build_generation)
        plane = startup.start("data_plane", ctx.build_data_plane)
        startup.wait()
        self.environments, self.policy = environments.value, policy.value
        self.generation, self.plane = generation.value, plane.value

    # ------------------------------------------------------------------ the loop's steps

    def start(self, step: int) -> None:
        """A resumed run refits the generation backend to the restored weights; a colocated
        policy gives its devices to generation until the first training pass."""
        if step:
            refit(self.policy, self.generation, self.config.generation.refit_bucket_bytes, version=step)
        if self.colocated:
            self.policy.offload()

    def train_step(self, step: int) -> dict[str, float] | None:
        """One GRPO step; None when the data ran out before the step's batch was full."""
        timer = StageTimer()
        with timer("step"):
            self.generation.set_sampling_seed(step_seed(self.config.seed, "train", step))
            partition = f"train/{step}"
            try:
                with timer("rollout"):
                    collected = self.collect_batch(partition)
                if collected is None:
                    return None
                keys, rollout_metrics = collected
                with timer("data_plane"):
                    trained = self.plane.get(partition, keys, METRIC_FIELDS)
                with timer("logprobs"):
                    if self.colocated:
                        self.policy.prepare_for_training()
                    self.add_logprobs(partition, keys)
                with timer("training"):
                    fields = [*TRAIN_FIELDS, *(["prev_logprobs"] if self.needs_prev else []),
                              *(["reference_logprobs"] if self.needs_reference else [])]
                    train_metrics = self.optimize(step, PlaneSamples(self.plane, partition, keys, fields))
                with timer("refit"):
                    stats = refit(self.policy, self.generation, self.config.generation.refit_bucket_bytes, version=step)
                    if self.colocated:
                        self.policy.offload()
            finally:
                self.plane.clear(partition)

        timings = timer.metrics()
        return {
            **rollout_metrics,
            **batch_metrics(trained),
            **train_metrics,
            "refit/seconds": stats.seconds,
            "refit/bytes": float(stats.bytes_moved),
            **timings,
            **throughput(float(trained["input_lengths"].sum()), rollout_metrics["rollout/generated_tokens"], timings),
        }

    # ------------------------------------------------------------------ stages

    def collect_batch(self, partition: str) -> tuple[list[str], dict[str, float]] | None:
        """Roll out prompt batches, score them and write them into ``partition`` until the
        step's batch is full: one rollout, or with dynamic sampling as many as it takes to
        collect ``num_prompts_per_step`` groups whose rewards differ. Dynamic sampling reads
        only the rollouts' ``signal_reward`` tags, so dropped groups are never fetched.
        Returns the keys of the samples to train on and the rollout metrics; None when the
        data runs out."""
        grpo = self.grpo
        group_size = grpo.num_generations_per_prompt
        sampler = (
            DynamicSampler(grpo.num_prompts_per_step, grpo.num_generations_per_prompt, grpo.dynamic_sampling.max_gen_batches)
            if grpo.dynamic_sampling.enabled
            else None
        )
        rollouts: list[tuple[Batch, dict[str, float]]] = []
        prompts_rolled_out = 0
        self.generation.prepare_for_generation()
        try:
            while True:
                prompts = self.prompts.next()
                if prompts is None:
                    return None
                batch, metrics = self.rollout(prompts, greedy=False, repeats=group_size)
                rollouts.append((batch, metrics))
                signal = score(batch, grpo, self.config.generation.max_new_tokens)
                keys = sample_keys(len(prompts), group_size, first_prompt=prompts_rolled_out)
                prompts_rolled_out += len(prompts)
                self.plane.put(partition, keys, batch.fields(ROLLOUT_FIELDS), tags={SIGNAL_TAG: signal})
                if sampler is None:
                    return keys, rollout_summary(rollouts)
                sampler.add(keys, self.plane.tags(partition, keys)[SIGNAL_TAG])
                if sampler.done:
                    return sampler.take(), {**rollout_summary(rollouts), **sampler.metrics()}
        finally:
            self.generation.finish_generation()

    def rollout(self, prompts: Batch, *, greedy: bool, repeats: int) -> tuple[Batch, dict[str, float]]:
        """Each prompt ``repeats`` times in a row, rolled out through the environments."""
        samples = prompts.fields(PROMPT_FIELDS)
        samples["task"] = [task or self.default_task for task in samples["task"]]
        return run_rollout(
            samples.repeat_interleave(repeats),
            self.generation,
            self.environments,
            self.tokenizer,
            max_total_length=self.config.policy.max_total_sequence_length,
            max_turns=self.grpo.max_rollout_turns,
            greedy=greedy,
            chat_template=self.chat_template,
        )

    def add_logprobs(self, partition: str, keys: list[str]) -> None:
        """Write ``prev_logprobs`` (unless on policy) and ``reference_logprobs`` (when needed)
        of the partition's samples into the partition (the policy's workers may fetch and
        write them themselves)."""
        samples = PlaneSamples(self.plane, partition, keys, LOGPROB_FIELDS)
        if self.needs_prev:
            self.policy.logprobs_into(samples, "prev_logprobs")
        if self.needs_reference:
            self.policy.logprobs_into(samples, "reference_logprobs", reference=True)

    def optimize(self, step: int, samples: PlaneSamples) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` samples, in order;
        raises :class:`TrainingDiverged` at the first non-finite loss or gradient norm."""
        parts = []
        for chunk in samples.chunks(self.config.policy.train_global_batch_size):
            metrics = self.policy.train_from(chunk, self.loss_fn)
            bad = first_nonfinite(metrics, ("loss", "grad_norm"))
            if bad is not None:
                raise self.diverged(step, bad, metrics[bad], chunk.get())
            parts.append(metrics)
        return combine_train_passes(parts, self.loss_fn.metric_reductions)

    def diverged(self, step: int, metric: str, value: float, batch: Batch) -> TrainingDiverged:
        latest = self.ctx.checkpoints.latest() if self.ctx.checkpoints is not None else None
        inputs = nonfinite_fields(batch)
        return TrainingDiverged(
            f"GRPO step {step}: the training metric '{metric}' is {value}. The optimizer step has run with it, "
            f"so the run stops here without saving; the last checkpoint "
            f"({latest if latest is not None else 'none was saved yet'}) is left as it was. "
            f"Non-finite inputs in the step's batch: {', '.join(inputs) if inputs else 'none'}. "
            "Lower policy.optimizer.lr or set policy.max_grad_norm, check the environments' rewards, "
            "then resume from the checkpoint."
        )

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> dict[str, float] | None:
        """Greedy rollouts of the validation prompts: ``accuracy`` (mean environment reward),
        the mean response length, and the rollout and environment metrics; None without
        validation prompts."""
        if self.val_prompts is None:
            return None
        timer = StageTimer()
        partition = f"validation/{step}"
        with timer("validation"):
            self.generation.set_sampling_seed(step_seed(self.config.seed, "validation", step))
            self.generation.prepare_for_generation()
            try:
                batch, metrics = self.rollout(self.val_prompts, greedy=True, repeats=1)
            finally:
                self.generation.finish_generation()
            keys = sample_keys(len(batch), 1)
            self.plane.put(partition, keys, batch.fields(("rewards", "response_lengths")))
            try:
                results = self.plane.get(partition, keys, ("rewards", "response_lengths"))
            finally:
                self.plane.clear(partition)
        return {
            "accuracy": float(results["rewards"].float().mean()),
            "mean_response_length": float(results["response_lengths"].float().mean()),
            **metrics,
            **timer.metrics(),
        }


def environment_names(
    config: Any, datasets: Sequence[TokenizedDataset | None], *, plugins: Sequence[str] = ()
) -> tuple[list[str], str | None]:
    """The environments to start (every ``task`` named by the data plus every name under
    ``environments``) and the task of rows that name none (the only environment, or None
    when every row names its task).

    Every name must be registered (in this process's plugin host, plus the extra plugin
    modules ``plugins``), checked here, before Ray or any worker starts: an unknown task
    names the config key of its data, the file and the row."""
    registry = host_with(plugins).environments
    for name in config.environments:
        if name not in registry:
            raise ConfigError(
                f"environments.{name}: {registry.unknown_message(name)}{where_set(config, f'environments.{name}')}"
            )
    tasks: set[str | None] = set()
    for dataset in datasets:
        if dataset is None:
            continue
        for task, row in zip(dataset.table["task"], dataset.table["row"], strict=True):
            if task and task not in registry:
                key = dataset.report.key or "the data"
                raise ConfigError(
                    f"{key} ({dataset.report.source}) row {row}, key 'task': {registry.unknown_message(task)} "
                    f"Correct the row's task, or install the plugin that provides "
                    f"'{task}'.{where_set(config, key)}"
                )
            tasks.add(task)
    names = sorted({*config.environments, *(task for task in tasks if task)})
    if not names:
        raise ConfigError(
            "GRPO needs an environment to score responses, but the data rows name no 'task' and the config has "
            "no 'environments' section; add e.g. 'environments: {math: {}}' or a 'task' to every data row"
        )
    if None not in tasks and "" not in tasks:
        return names, None
    if len(names) > 1:
        raise ConfigError(
            f"some data rows have no 'task', and there are {len(names)} environments ({', '.join(names)}) they "
            "could go to; give every row a 'task', or configure exactly one environment under 'environments'"
        )
    return names, names[0]


def _shutdown_environments(environments: Mapping[str, Environment]) -> None:
    for env in environments.values():
        env.shutdown()


def _validation_prompts(dataset: TokenizedDataset, max_samples: int | None) -> Batch:
    count = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    return dataset.collate(list(range(count)))
