"""GRPO (``posttrain run grpo``): its steps, written once, against the interfaces only, run
by core's :class:`~posttrain.run.loop.TrainingLoop`.

One step, as data::

    round s (see below): prompts (grpo.num_prompts_per_step, from the resumable data loader)
      -> x grpo.num_generations_per_prompt -> rollout: generation backend + environments,
         up to grpo.max_rollout_turns turns
      -> rewards scaled and length-shaped -> group advantages -> overlong filtering
      -> data plane partition "train/<step>", each sample tagged with its signal reward and
         the oldest weight version that generated it
      -> dynamic sampling: more rollouts until the step holds enough informative groups,
         decided from the tags alone (dropped groups are never fetched)
    step s: takes round s; groups older than grpo.asynchronous.max_staleness_steps are
      dropped (sample_mask 0) and counted
      -> every pass below reads the kept samples' inputs from the partition
      -> previous logprobs (only with several optimizer steps per batch: on policy the
         training pass's own, detached; never with grpo.loss.rollout_correction=bypass, which
         a synchronous run with exact logprobs (generation.exact_logprobs) takes) and
         reference logprobs when grpo.loss.kl_penalty > 0
      -> policy.train(clipped_pg), one optimizer step per policy.train_global_batch_size
      -> refit the generation backend -> clear the partition
      -> metrics -> validation every grpo.val_period steps -> checkpoint every
         checkpointing.save_period steps and at the end

Rounds and steps: a :class:`~posttrain_grpo.rounds.RoundProducer` produces the rounds in a
driver thread, on the generation engines and the environment actors. Synchronous GRPO
(``grpo.asynchronous.max_staleness_steps`` = 0, the default) starts round s when step s asks
for it and waits; asynchronous GRPO (k >= 1, engines on their own workers) generates up to k
rounds ahead while the steps train, and the engines take each step's weights between two
requests (or, without in-flight updates, between two rounds). One loop for both: k = 0
is the synchronous algorithm, not a separate path.

Stop, resume, validation and checkpoint periods, the export: core's loop (see
:mod:`posttrain.run.loop`). Validation pauses the rounds (it uses the same engines). A resumed run restores the policy (weights, optimizer,
scheduler), the data loader position and the driver's random states from the latest
checkpoint, refits the generation backend, and continues with the next step. Sampling does
not depend on the process: before each round the generation backend is reseeded from
``(seed, step)`` (:func:`~posttrain_grpo.step.step_seed`), so a resumed synchronous run
samples exactly what an uninterrupted run would. A checkpoint keeps the data position after
the prompts of its step: rounds generated ahead and not trained when a run stops are
discarded (logged with their count) and rolled out again, from the same prompts, by the
resumed run.

A non-finite loss or gradient norm stops the run with :class:`~posttrain_grpo.step.TrainingDiverged`
naming the step and the metric; no checkpoint is written after it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from posttrain.batch import Batch
from posttrain.config.exact import rollout_logprobs_are_the_trainers
from posttrain.data import (
    TokenizedDataset,
    dataloader_from_config,
    dataset_from_config,
    encoder_from_config,
    require_dataset,
)
from posttrain.errors import WorkerError
from posttrain.interfaces import ROUTES_FIELD, Algorithm, PlaneSamples
from posttrain.run.checkpoint import TrainingState
from posttrain.run.context import RunContext
from posttrain.run.environments import environment_names, shutdown_environments
from posttrain.run.finished import finished_run
from posttrain.run.loop import LoopPlan, LoopSteps, TrainingLoop
from posttrain.run.metrics import StageTimer, combine_train_passes
from posttrain.run.prompt_rollout import PromptRollout, validate_greedy
from posttrain.run.refit import refit
from posttrain.run.startup import Startup
from posttrain_grpo.agents import AgentRollout, load_agent
from posttrain_grpo.config import GRPOConfig
from posttrain_grpo.dynamic_sampling import DynamicSampler
from posttrain_grpo.endpoint import ChatEndpoint
from posttrain_grpo.mismatch import check_mismatch, first_update_mismatch
from posttrain_grpo.mismatch_buckets import mismatch_means
from posttrain_grpo.prompts import PromptStream
from posttrain_grpo.rounds import RoundProducer, SharedPlane
from posttrain_grpo.step import (
    LOGPROB_FIELDS,
    METRIC_FIELDS,
    ROLLOUT_FIELDS,
    SIGNAL_TAG,
    STALENESS_FIELDS,
    TRAIN_FIELDS,
    VERSION_TAG,
    TrainingDiverged,
    batch_metrics,
    first_nonfinite,
    nonfinite_fields,
    rollout_summary,
    sample_keys,
    sample_versions,
    score,
    staleness_metrics,
    step_seed,
    throughput,
)
from posttrain_grpo.workers import with_rows_per_call, worker_sections


@attrs.frozen
class Rollouts:
    """What round ``step`` produced for step ``step``: the samples to train on (``keys`` of
    ``partition``), the rollout metrics, the data position after its prompts, its wall
    seconds and the prompt groups it generated (dynamic sampling's dropped ones included)."""

    step: int
    partition: str
    keys: list[str]
    metrics: dict[str, float]
    position: dict[str, Any]
    seconds: float
    groups_generated: int


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
        run = self.steps(context)
        finished = finished_run(context, run.plan)
        if finished is not None:
            return finished
        with contextlib.ExitStack() as cleanup:
            run.start_services(cleanup)
            cleanup.callback(run.close_rounds)  # before the services shut down
            return TrainingLoop(context, run.plan, run, run.training_state()).run()

    def steps(self, context: RunContext) -> GRPORun:
        """The run's steps (an algorithm built on GRPO's loop returns its subclass)."""
        return GRPORun(context, self.environment_plugins)


class GRPORun(LoopSteps):
    """One run's data, plan and steps. The constructor reads the data and fixes the plan;
    :meth:`start_services` starts the workers, engines, environments and data plane the steps use.

    An algorithm built on GRPO's loop (PPO) subclasses it: :attr:`label` names it, and it may
    add to :meth:`start_services` (its own parts, started with GRPO's: :meth:`start_more`),
    :meth:`add_logprobs` (what the step computes before training), :meth:`optimize` and
    :meth:`training_state`."""

    label = "GRPO"

    def __init__(self, ctx: RunContext, environment_plugins: Sequence[str]):
        self.ctx = ctx
        self.environment_plugins = tuple(environment_plugins)
        self.config = config = ctx.config
        self.grpo: GRPOConfig = config.section("grpo")
        encoder = encoder_from_config(config)
        self.tokenizer, self.chat_template, self.images = encoder.tokenizer, encoder.template, encoder.images
        train_set = require_dataset(config, "train", "prompt", encoder)
        val_set = dataset_from_config(config, "validation", "prompt", encoder)
        agent = self.grpo.agent
        self.agent = load_agent(agent.entry, "grpo.agent.entry") if agent.entry else None
        self.endpoint: ChatEndpoint | None = None
        names, self.default_task = (
            ([], None) if self.agent else environment_names(config, [train_set, val_set], plugins=environment_plugins)
        )
        self.environment_names = names
        self.prompts = PromptStream(
            dataloader_from_config(config, train_set, self.grpo.num_prompts_per_step), self.grpo.max_num_epochs
        )
        self.val_prompts = _validation_prompts(val_set, self.grpo.max_val_samples) if val_set is not None else None
        total_steps = min(self.grpo.max_num_steps, self.prompts.total_batches)
        updates_per_step = max(1, self.grpo.samples_per_step // config.policy.train_global_batch_size)
        self.plan = LoopPlan(
            label=self.label,
            total_steps=total_steps,
            schedule_steps=total_steps * updates_per_step,
            val_period=self.grpo.val_period,
            val_at_start=self.grpo.val_at_start,
            export_dir=self.grpo.export_dir,
            length_keys=("grpo.max_num_steps", "grpo.max_num_epochs"),
        )
        exact = rollout_logprobs_are_the_trainers(config, ctx.host)
        loss = self.grpo.effective_loss(config.generation.max_new_tokens, exact_rollouts=exact)
        if loss.rollout_correction != self.grpo.loss.rollout_correction:
            ctx.log.info("exact logprobs: the rollouts' logprobs are the previous policy's, so the loss takes them "
                         "(grpo.loss.rollout_correction=bypass) and no previous-logprob pass runs")
        self.loss_fn = ctx.build_loss("clipped_pg", loss)
        self.bypass = loss.rollout_correction == "bypass"  # the ratio against the engine's logprobs
        self.needs_reference = self.grpo.loss.kl_penalty > 0 or not self.grpo.skip_reference_logprobs_when_kl_off
        # On policy or not, the one optimizer step of a step starts from the weights the step's
        # logprobs would be computed with: prev_logprobs are the training pass's own. In bypass
        # mode the loss takes the generation engine's logprobs instead.
        # policy.moe.routing_replay: previous replays the experts of the previous-logprob pass: it always runs
        self.replays_previous = config.policy.moe.routing_replay == "previous"
        self.needs_prev = loss.rollout_correction == "decoupled" and (
            updates_per_step > 1 or not self.grpo.skip_prev_logprobs_when_on_policy or self.replays_previous
        )
        self.colocated = config.generation.colocated
        # what goes with a sample to every policy pass beside its tokens: the engine's experts of each
        # token (policy.moe), a vision-language model's images
        self.model_fields = (*((ROUTES_FIELD,) if config.policy.moe.records_routes else ()),
                             *(self.images.fields if self.images is not None else ()))
        self.rounds: RoundProducer[Rollouts] | None = None
        self.weights_version = 0  # of the weights the engines hold: the refit after step s carries s
        # When the prompts ran out while a round was being collected: the prompt batches it drew
        # and the informative groups it had kept (dynamic sampling)
        self.shortfall: tuple[int, int] | None = None

    def start_services(self, cleanup: contextlib.ExitStack) -> None:
        """Start the environments, the policy, the generation backend and the data plane, all
        at once (:meth:`RunContext.startup`); ``cleanup`` shuts them down."""
        ctx = self.ctx
        ctx.start_cluster()
        startup = ctx.startup(cleanup)
        environments = startup.start(
            "environments", lambda: ctx.build_environments(self.environment_names, plugins=self.environment_plugins),
            shutdown_environments,
        )
        policy_section, generation_section = worker_sections(self.config, self.grpo)
        if (policy_section, generation_section) != (self.config.policy, self.config.generation):
            ctx.log.info("asynchronous GRPO on CPUs: idle OpenMP threads of the policy and the engines sleep",
                         OMP_WAIT_POLICY="PASSIVE", unless_set_in="policy|generation.resources.env_vars")
        policy = startup.start(
            "policy", lambda: ctx.build_policy(
                schedule_steps=self.plan.schedule_steps, policy=policy_section, reference=self.needs_reference
            )
        )
        validation_prompts = 0 if self.val_prompts is None else len(self.val_prompts)
        generation_section = with_rows_per_call(generation_section, self.grpo, validation_prompts)
        generation = startup.start("generation", lambda: ctx.build_generation(generation_section, host=policy))
        plane = startup.start("data_plane", lambda: SharedPlane(ctx.build_data_plane()))
        self.start_more(startup)
        startup.wait()
        self.environments, self.policy = environments.value, policy.value
        self.generation, self.plane = generation.value, plane.value
        if self.agent is not None:
            agent = self.grpo.agent
            self.endpoint = ChatEndpoint(
                self.generation, self.tokenizer, chat_template=self.chat_template,
                max_total_length=self.config.policy.max_total_sequence_length,
                tool_call_format=agent.tool_call_format, host=agent.host, port=agent.port,
            )
            cleanup.callback(self.endpoint.shutdown)  # before the engines it serves from
            ctx.log.info("agents roll out through the chat endpoint", address=self.endpoint.address, agent=agent.entry)
            self.rollout = AgentRollout(self.endpoint, self.agent, agent.max_concurrency, agent.timeout_s)
        else:
            self.rollout = PromptRollout(
                self.generation, self.environments, self.tokenizer, self.config.policy.max_total_sequence_length,
                self.grpo.max_rollout_turns, self.chat_template, self.default_task, self.images,
            )

    def start_more(self, startup: Startup) -> None:
        """Start an algorithm's own parts (e.g. PPO's critic) with GRPO's, all at once: its
        ``startup.start`` calls go here; :meth:`start_services` waits for every part."""

    def training_state(self) -> TrainingState:
        """What a checkpoint holds: the policy and the prompt stream's position."""
        return TrainingState(self.policy, self.prompts)

    # ------------------------------------------------------------------ the loop's steps

    def start(self, step: int) -> None:
        """A resumed run refits the generation backend to the restored weights; a colocated
        policy gives its devices to generation until the first training pass. The rounds
        start from the step after ``step``."""
        if step:
            refit(self.policy, self.generation, self.config.generation.refit_bucket_bytes, version=step)
        self.weights_version = step
        if self.colocated:
            self.policy.offload()
        run_ahead = self.grpo.asynchronous
        self.rounds = RoundProducer(
            self.produce_round,
            ahead=run_ahead.rounds_ahead(self.grpo.num_prompts_per_step),
            first_round=step + 1,
            last_round=self.plan.total_steps,
            in_flight_weight_updates=run_ahead.in_flight_weight_updates,
        )

    def close_rounds(self) -> None:
        """Stop the rounds; rounds generated ahead and never trained on are discarded and
        logged with their count (a resumed run rolls their prompts out again)."""
        if self.rounds is None:
            return
        untaken = self.rounds.close()
        for rollouts in untaken.values():
            self.plane.clear(rollouts.partition)
        if untaken:
            self.ctx.log.info(
                "rollouts generated ahead were discarded",
                steps=sorted(untaken),
                groups=sum(r.groups_generated for r in untaken.values()),
            )

    def train_step(self, step: int) -> dict[str, float] | None:
        """One GRPO step on round ``step``; None when the data ran out before the round was full."""
        assert self.rounds is not None, "start() runs before the first step"
        timer = StageTimer()
        with timer("step"):
            with timer("rollout_wait"):
                rollouts = self.rounds.take(step)
            if rollouts is None:
                return None
            partition, keys = rollouts.partition, rollouts.keys
            self.prompts.trained(rollouts.position)
            try:
                staleness = self.drop_stale(step, partition, keys)
                with timer("data_plane"):
                    trained = self.plane.get(partition, keys, METRIC_FIELDS)
                with timer("logprobs"):
                    if self.colocated:
                        self.policy.prepare_for_training()
                    self.add_logprobs(partition, keys)
                with timer("training"):
                    fields = [*TRAIN_FIELDS, *self.model_fields, *(["prev_logprobs"] if self.needs_prev else []),
                              *([ROUTES_FIELD] if self.replays_previous else []),
                              *(STALENESS_FIELDS if self.grpo.asynchronous.enabled else []),
                              *(["reference_logprobs"] if self.needs_reference else [])]
                    train_metrics = self.optimize(step, PlaneSamples(self.plane, partition, keys, fields))
                with timer("refit"):
                    with self.rounds.refit_window():
                        stats = refit(self.policy, self.generation, self.config.generation.refit_bucket_bytes, version=step)
                    self.weights_version = step
                    if self.colocated:
                        self.policy.offload()
            finally:
                self.plane.clear(partition)

        timings = {**timer.metrics(), "timing/rollout": rollouts.seconds}
        if not self.grpo.asynchronous.enabled:  # the step waited for the whole rollout: one number
            timings.pop("timing/rollout_wait")
        return {
            **rollouts.metrics,
            **batch_metrics(trained),
            **train_metrics,
            **({**staleness, "async/groups_generated": float(rollouts.groups_generated)}
               if self.grpo.asynchronous.enabled else {}),
            "refit/seconds": stats.seconds,
            "refit/bytes": float(stats.bytes_moved),
            **timings,
            **throughput(float(trained["input_lengths"].sum()), rollouts.metrics["rollout/generated_tokens"], timings),
        }

    def out_of_data(self, step: int) -> str:
        """Why round ``step`` could not be filled: dynamic sampling drew the last prompt batch
        of the last epoch first; and the settings that let a run go on, from the batches a
        step took so far (see :meth:`~posttrain.run.loop.LoopSteps.out_of_data`)."""
        drawn, kept = self.shortfall or (0, 0)
        grpo = self.grpo
        per_epoch, total = len(self.prompts.loader), self.prompts.total_batches
        why = (f"the prompts ran out (grpo.max_num_epochs={grpo.max_num_epochs} epochs of {per_epoch} prompt batches) "
               f"while dynamic sampling filled step {step}: its {drawn} batches gave {kept} of the "
               f"{grpo.num_prompts_per_step} prompts with differing rewards a step needs")
        done = step - 1 + kept / grpo.num_prompts_per_step  # steps' worth of informative groups from all batches
        if not done:
            return (f"{why}. Set grpo.max_num_epochs above {grpo.max_num_epochs}, use more prompts, or prompts the "
                    "policy solves only sometimes")
        per_step = total / done
        epochs = max(grpo.max_num_epochs + 1, math.ceil(1.2 * per_step * self.plan.total_steps / per_epoch))
        return (f"{why}; so far a step took {per_step:.1f} batches. Set grpo.max_num_epochs: {epochs} (that many for "
                f"{self.plan.total_steps} steps, with a margin){f', or grpo.max_num_steps: {step - 1}' if step > 1 else ''}")

    def drop_stale(self, step: int, partition: str, keys: list[str]) -> dict[str, float]:
        """Drop (``sample_mask`` 0) the groups of the step's samples with a sample older than
        ``grpo.asynchronous.max_staleness_steps`` versions; return the staleness metrics. An
        asynchronous step tags its samples with the version it trains (``trained_version``)."""
        group = self.grpo.num_generations_per_prompt
        versions = self.plane.tags(partition, keys)[VERSION_TAG]
        stale_groups = ((step - 1) - versions > self.grpo.asynchronous.max_staleness_steps).view(-1, group).any(dim=1)
        if stale_groups.any():
            stale = [key for key, drop in zip(keys, stale_groups.repeat_interleave(group).tolist(), strict=True) if drop]
            self.plane.put(partition, stale, {"sample_mask": torch.zeros(len(stale))})
        if self.grpo.asynchronous.enabled:
            self.plane.put(partition, keys, {"trained_version": torch.full((len(keys),), step - 1, dtype=torch.long)})
        return staleness_metrics(step, versions, stale_groups)

    # ------------------------------------------------------------------ rounds

    def produce_round(self, step: int) -> Rollouts | None:
        """Round ``step`` (run by :attr:`rounds`, in its thread): the step's rollouts, written
        into partition ``train/<step>``; None (the partition cleared) when the data ran out."""
        began = time.perf_counter()
        partition = f"train/{step}"
        self.generation.set_sampling_seed(step_seed(self.config.seed, "train", step))
        try:
            collected = self.collect_batch(partition)
        except BaseException:
            self.plane.clear(partition)
            raise
        if collected is None:
            self.plane.clear(partition)
            return None
        keys, metrics, groups_generated = collected
        position = self.prompts.position()
        return Rollouts(step, partition, keys, metrics, position, time.perf_counter() - began, groups_generated)

    # ------------------------------------------------------------------ stages

    def collect_batch(self, partition: str) -> tuple[list[str], dict[str, float], int] | None:
        """Roll out prompt batches, score them and write them into ``partition`` until the
        step's batch is full: one rollout, or with dynamic sampling as many as it takes to
        collect ``num_prompts_per_step`` groups whose rewards differ. Dynamic sampling reads
        only the rollouts' ``signal_reward`` tags, so dropped groups are never fetched.
        Returns the keys of the samples to train on, the rollout metrics and the number of
        prompt groups rolled out; None when the data runs out."""
        grpo = self.grpo
        group_size = grpo.num_generations_per_prompt
        sampler = (
            DynamicSampler(grpo.num_prompts_per_step, grpo.num_generations_per_prompt, grpo.dynamic_sampling.max_gen_batches)
            if grpo.dynamic_sampling.enabled
            else None
        )
        rollouts: list[tuple[Batch, dict[str, float]]] = []
        prompts_rolled_out = 0
        version = self.weights_version
        self.generation.prepare_for_generation()
        try:
            while True:
                prompts = self.prompts.next()
                if prompts is None:
                    self.shortfall = (len(rollouts), sampler.groups_kept if sampler is not None else 0)
                    return None
                batch, metrics = self.rollout(prompts, greedy=False, repeats=group_size)
                rollouts.append((batch, metrics))
                signal = score(batch, grpo, self.config.generation.max_new_tokens)
                keys = sample_keys(len(prompts), group_size, first_prompt=prompts_rolled_out)
                prompts_rolled_out += len(prompts)
                tags = {SIGNAL_TAG: signal, VERSION_TAG: self.sample_versions(batch, version)}
                fields = (*ROLLOUT_FIELDS, *self.model_fields,
                          *(["generation_versions"] if "generation_versions" in batch else []))
                self.plane.put(partition, keys, batch.fields(fields), tags=tags)
                if sampler is None:
                    return keys, rollout_summary(rollouts), prompts_rolled_out
                sampler.add(keys, self.plane.tags(partition, keys)[SIGNAL_TAG])
                if sampler.done:
                    return sampler.take(), {**rollout_summary(rollouts), **sampler.metrics()}, prompts_rolled_out
        finally:
            self.generation.finish_generation()

    def sample_versions(self, batch: Batch, round_version: int) -> torch.Tensor:
        """The oldest weight version behind each sample of a rollout batch (see
        :func:`~posttrain_grpo.step.sample_versions`). A backend that does not report
        versions is taken at ``round_version`` (the engines' weights when the round began),
        which only synchronous GRPO may do: no weights change during its rounds."""
        if "generation_versions" not in batch and self.grpo.asynchronous.enabled:
            raise WorkerError(
                f"generation.backend '{self.config.generation.backend}' does not report which weights generated each "
                "sample (the output field weight_versions), which asynchronous GRPO needs to bound how old a sample "
                "may be. Use a backend that reports it (vllm, hf), or set grpo.asynchronous.max_staleness_steps=0."
            )
        return sample_versions(batch, round_version)

    def add_logprobs(self, partition: str, keys: list[str]) -> None:
        """Write ``prev_logprobs`` (unless on policy) and ``reference_logprobs`` (when needed)
        of the partition's samples into the partition (the policy's workers may fetch and
        write them themselves); with ``policy.moe.routing_replay: previous`` the first pass also
        writes the experts its routers chose (``routed_experts``), which the training passes replay."""
        samples = PlaneSamples(self.plane, partition, keys, (*LOGPROB_FIELDS, *self.model_fields))
        if self.needs_prev:
            self.policy.logprobs_into(samples, "prev_logprobs")
        if self.needs_reference:
            self.policy.logprobs_into(samples, "reference_logprobs", reference=True)

    def optimize(self, step: int, samples: PlaneSamples) -> dict[str, float]:
        """One optimizer step per ``policy.train_global_batch_size`` samples, in order;
        raises :class:`TrainingDiverged` at the first non-finite loss or gradient norm, and
        :class:`~posttrain_grpo.mismatch.MismatchTooLarge` past a stop bound of
        ``grpo.mismatch_guard`` (warns past a warn bound)."""
        parts = []
        for chunk in samples.chunks(self.config.policy.train_global_batch_size):
            metrics = mismatch_means(self.policy.train_from(chunk, self.loss_fn))
            bad = first_nonfinite(metrics, ("loss", "grad_norm"))
            if bad is not None:
                raise self.diverged(step, bad, metrics[bad], chunk.get())
            parts.append(metrics)
        if self.bypass:
            parts = first_update_mismatch(parts)
        metrics = combine_train_passes(parts, self.loss_fn.metric_reductions)
        for warning in check_mismatch(step, metrics, self.grpo.mismatch_guard):
            self.ctx.log.warning("the generation engine's logprobs are far from the trainer's", step=step, detail=warning)
        return metrics

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
        """Greedy rollouts of the validation prompts (:func:`posttrain.run.prompt_rollout.validate_greedy`,
        one completion each): ``accuracy`` (the mean environment reward: pass@1 for rewards of
        0 or 1), the mean response length, and the rollout and environment metrics; None
        without validation prompts."""
        if self.val_prompts is None:
            return None
        timer = StageTimer()
        assert self.rounds is not None, "start() runs before the first validation"
        with timer("validation"), self.rounds.paused():
            metrics = validate_greedy(self.val_prompts, self.rollout, self.generation,
                                      step_seed(self.config.seed, "validation", step))
        return {**metrics, **timer.metrics()}


def _validation_prompts(dataset: TokenizedDataset, max_samples: int | None) -> Batch:
    count = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    return dataset.collate(list(range(count)))
