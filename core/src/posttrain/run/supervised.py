"""The supervised algorithm: one loss over a fixed dataset (SFT, DPO, and the algorithms to
come that train on a dataset: reward models, distillation).

One step: the next global batch from the resumable data loader -> the data plane
(partition ``train/<step>``) -> the algorithm's :meth:`~SupervisedAlgorithm.prepare_batch`
(DPO writes the reference logprobs into the partition) -> ``policy.train_from(samples,
loss)`` (the policy reads the partition; its workers may fetch their own shards) -> the
partition is cleared. Validation batches go through partitions of their own
(``validation/<step>/<batch>``). Around the steps, :class:`~posttrain.run.loop.TrainingLoop`:
resume, validation (``val_at_start``, every ``val_period`` steps, ``val_at_end``),
checkpoints, the export and stop requests. Options: a
:class:`~posttrain.run.supervised_config.SupervisedConfig` section.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from posttrain.batch import Batch
from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.data import (
    StatefulDataLoader,
    dataloader_from_config,
    dataset_from_config,
    encoder_from_config,
    require_dataset,
)
from posttrain.interfaces.algorithm import Algorithm
from posttrain.interfaces.data_plane import DataPlane, PlaneSamples
from posttrain.interfaces.loss import LossFunction, LossType, combine_metrics
from posttrain.interfaces.policy import Policy
from posttrain.run.checkpoint import TrainingState
from posttrain.run.context import RunContext
from posttrain.run.finished import finished_run
from posttrain.run.loop import LoopPlan, LoopSteps, TrainingLoop
from posttrain.run.metrics import PASS_METRICS
from posttrain.run.supervised_config import SupervisedConfig


class SupervisedAlgorithm(Algorithm):
    """An algorithm that trains on a fixed dataset with one loss.

    Subclasses name their config section (a :class:`SupervisedConfig` subclass), the dataset
    kind they read, how many batch rows one example gives, and may add fields to each batch
    in :meth:`prepare_batch`. ``policy.train_global_batch_size`` counts rows.
    """

    data_kind = "sft"
    rows_per_example = 1

    def policy_config(self, config: RunConfig) -> PolicyConfig:
        """The ``policy`` section the model is built with: the run's, by default (a reward
        model's algorithm asks for a value head here)."""
        return config.policy

    def prepare_batch(self, policy: Policy, samples: PlaneSamples, options: Any) -> PlaneSamples:
        """Write what the loss needs beyond the collated rows into the samples' data plane
        and return the samples with those fields added (``options``: the algorithm's
        section; by default nothing is added)."""
        return samples

    def uses_reference(self, options: Any) -> bool:
        """Whether :meth:`prepare_batch` asks the policy for reference logprobs (by default
        not: the policy then keeps no copy of the initial weights)."""
        return False

    def run(self, context: RunContext) -> dict[str, Any]:
        return SupervisedRun(self, context).fit()


class SupervisedRun(LoopSteps):
    """One run of a :class:`SupervisedAlgorithm`: its data, loss and plan; the policy and the
    data plane while :meth:`fit` runs."""

    def __init__(self, algorithm: SupervisedAlgorithm, context: RunContext):
        config = context.config
        self.algorithm = algorithm
        self.context = context
        section = algorithm.config_section or algorithm.name
        self.options: SupervisedConfig = config.section(section)
        per = algorithm.rows_per_example
        train_rows = config.policy.train_global_batch_size
        encoder = encoder_from_config(config)
        train_set = require_dataset(config, "train", algorithm.data_kind, encoder)
        self.train_loader = dataloader_from_config(config, train_set, train_rows // per)
        val_set = dataset_from_config(config, "validation", algorithm.data_kind, encoder)
        val_rows = self.options.val_global_batch_size or train_rows
        self.val_loader: StatefulDataLoader | None = (
            None if val_set is None else dataloader_from_config(config, val_set, max(1, val_rows // per), train=False)
        )
        total_steps = planned_steps(self.options, len(self.train_loader))
        self.plan = LoopPlan(
            label=algorithm.name,
            total_steps=total_steps,
            schedule_steps=total_steps,
            val_period=self.options.val_period,
            val_at_start=self.options.val_at_start,
            val_at_end=self.options.val_at_end,
            export_dir=self.options.export_dir,
            length_keys=tuple(f"{section}.{key}" for key in ("max_num_steps", "max_num_epochs")),
        )
        self.loss_fn: LossFunction = context.build_loss(self.options.loss, self.options)
        self._policy: Policy | None = None
        self._plane: DataPlane | None = None
        self._batches = self._epoch_batches()

    @property
    def policy(self) -> Policy:
        assert self._policy is not None, "the policy exists while fit() runs"
        return self._policy

    @property
    def plane(self) -> DataPlane:
        assert self._plane is not None, "the data plane exists while fit() runs"
        return self._plane

    def fit(self) -> dict[str, Any]:
        """Start the policy and the data plane (at once: :meth:`RunContext.startup`), run the
        loop, shut both down; a run that already finished this plan starts nothing
        (:func:`~posttrain.run.finished.finished_run`)."""
        finished = finished_run(self.context, self.plan)
        if finished is not None:
            return finished
        context = self.context
        with contextlib.ExitStack() as cleanup:
            context.start_cluster()
            startup = context.startup(cleanup)
            policy = startup.start("policy", lambda: context.build_policy(
                schedule_steps=self.plan.schedule_steps, policy=self.algorithm.policy_config(context.config),
                reference=self.algorithm.uses_reference(self.options),
            ))
            plane = startup.start("data_plane", context.build_data_plane)
            startup.wait()
            self._policy, self._plane = policy.value, plane.value
            state = TrainingState(self._policy, self.train_loader)
            return TrainingLoop(context, self.plan, self, state).run()

    # ------------------------------------------------------------------ steps

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step over the next global batch. Besides the policy's metrics:
        ``step_time_s`` (wall time of the whole step, the algorithm's batch preparation
        included), ``total_tokens`` (prompt and answer), ``tokens_per_s`` and ``epoch``."""
        epoch, batch = next(self._batches)
        start = time.perf_counter()
        metrics = self.train_through_plane(f"train/{step}", batch)
        elapsed = time.perf_counter() - start
        tokens = int(batch["input_lengths"].sum())
        metrics.update(step_time_s=elapsed, total_tokens=tokens, tokens_per_s=tokens / elapsed, epoch=epoch)
        return metrics

    def validate(self, step: int) -> dict[str, float] | None:
        """Loss and loss metrics over the validation set (or its first ``val_batches``
        batches), combined as over one batch: each batch's means weighted by its normaliser,
        the loss's extremes by max/min; the pass metrics (:data:`PASS_METRICS`) are left out.
        Plus ``time_s``. None without a validation set."""
        if self.val_loader is None:
            return None
        start = time.perf_counter()
        multiple = self.context.config.data_parallel_size * self.algorithm.rows_per_example
        parts: list[dict[str, float]] = []
        weights: list[float] = []
        for k, batch in enumerate(self.val_loader.epoch_batches(0)):
            if self.options.val_batches is not None and k >= self.options.val_batches:
                break
            batch = pad_rows(batch, multiple)
            weight = normaliser(batch, self.loss_fn)
            if weight > 0:
                metrics = self.train_through_plane(f"validation/{step}/{k}", batch, eval_mode=True)
                parts.append({name: value for name, value in metrics.items() if name not in PASS_METRICS})
                weights.append(weight)
        metrics = combine_metrics(parts, self.loss_fn.metric_reductions, default="mean", weights=weights)
        metrics["time_s"] = time.perf_counter() - start
        return metrics

    def train_through_plane(self, partition: str, batch: Batch, *, eval_mode: bool = False) -> dict[str, float]:
        """Put ``batch`` into ``partition`` of the data plane, let the algorithm add to it,
        train (or, with ``eval_mode``, evaluate) the policy on it from there; the partition
        is cleared afterwards, whatever happens."""
        keys = [str(i) for i in range(len(batch))]
        self.plane.put(partition, keys, batch)
        try:
            samples = self.algorithm.prepare_batch(self.policy, PlaneSamples(self.plane, partition, keys, list(batch)), self.options)
            return self.policy.train_from(samples, self.loss_fn, eval_mode=eval_mode)
        finally:
            self.plane.clear(partition)

    def _epoch_batches(self) -> Iterator[tuple[int, Batch]]:
        """``(epoch, global batch)`` from the loader's current position on, epoch after epoch."""
        while True:
            epoch = self.train_loader.epoch
            for batch in self.train_loader:
                yield epoch, batch


# ---------------------------------------------------------------------- helpers


def planned_steps(options: SupervisedConfig, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: ``max_num_epochs`` epochs, capped by ``max_num_steps``."""
    steps = options.max_num_epochs * batches_per_epoch
    return steps if options.max_num_steps is None else min(steps, options.max_num_steps)


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """``batch`` grown to a multiple of ``multiple`` rows by repeating its leading rows with
    ``sample_mask`` 0 (no loss, no metric weight). ``multiple`` must be a multiple of the row
    group size and ``len(batch)`` of it too, so repeated groups stay whole."""
    n = len(batch)
    extra = -n % multiple
    if not extra:
        return batch
    padded = batch.select(list(range(n)) + [i % n for i in range(extra)])
    mask = padded["sample_mask"].clone()
    mask[n:] = 0
    padded["sample_mask"] = mask
    return padded


def normaliser(batch: Batch, loss_fn: LossFunction) -> float:
    """What ``loss_fn`` divides by over ``batch``: valid tokens or valid sequences."""
    sample_mask = batch["sample_mask"].double()
    if loss_fn.loss_type is LossType.TOKEN:
        return float((batch["token_mask"].double() * sample_mask[:, None]).sum())
    return float(sample_mask.sum())
