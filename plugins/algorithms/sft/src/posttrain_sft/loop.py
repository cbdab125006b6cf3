"""The supervised training loop, written once for SFT and DPO.

One step: the next global batch from the resumable data loader -> the data plane
(partition ``train/<step>``) -> the algorithm's ``prepare_batch`` (DPO writes the reference
logprobs into the partition) -> ``policy.train_from(samples, loss)`` (the policy reads the
partition; its workers may fetch their own shards) -> the partition is cleared -> metrics to
every sink and the progress bar. Validation batches go through partitions of their own
(``validation/<step>/<batch>``). Around the steps: validation every
``val_period`` steps (and at the start / end when asked), a checkpoint every
``checkpointing.save_period`` steps and after the last step, resume from the latest
checkpoint, and an optional Hugging Face export of the final weights. After SIGINT / SIGTERM
(``context.stop_requested``) no new step starts: the last finished step is checkpointed and
the run returns without the end-of-run validation and export.

A checkpoint ``step_N/`` holds ``policy/`` (what the backend saves: weights, optimizer,
scheduler), ``dataloader.pt`` (the loader's position), ``rng.pt`` (the driver's Python,
NumPy and torch random states) and the manager's ``training_info.json`` / ``config.yaml``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.batch import Batch
from posttrain.config import dump_config
from posttrain.data import (
    StatefulDataLoader,
    dataloader_from_config,
    dataset_from_config,
    encoder_from_config,
    require_dataset,
)
from posttrain.interfaces.algorithm import Algorithm
from posttrain.interfaces.data_plane import DataPlane, PlaneSamples
from posttrain.interfaces.loss import LossFunction, LossType
from posttrain.interfaces.policy import Policy
from posttrain.run.checkpoint import rng_state, set_rng_state
from posttrain.run.context import with_schedule_horizon
from posttrain_sft.config import SFTConfig

if TYPE_CHECKING:
    from posttrain.run.context import RunContext

#: Metrics of ``policy.train`` that describe the pass, not the loss: not averaged over
#: validation batches.
_PASS_METRICS = ("lr", "num_tokens", "step_time_s", "grad_norm")


class SupervisedAlgorithm(Algorithm):
    """An algorithm that trains on a fixed dataset with one loss (SFT, DPO).

    Subclasses name their config section (an :class:`SFTConfig` or a subclass), the dataset
    kind they read, how many batch rows one example gives, and may add fields to each batch
    in :meth:`prepare_batch`. ``policy.train_global_batch_size`` counts rows.
    """

    data_kind = "sft"
    rows_per_example = 1

    def prepare_batch(self, policy: Policy, samples: PlaneSamples, options: SFTConfig) -> PlaneSamples:
        """Write what the loss needs beyond the collated rows into the samples' data plane
        and return the samples with those fields added (SFT: nothing)."""
        return samples

    def run(self, context: RunContext) -> dict[str, Any]:
        return SupervisedRun(self, context).fit()


class SupervisedRun:
    """One run of a :class:`SupervisedAlgorithm`: data, loss, policy and the step counter."""

    def __init__(self, algorithm: SupervisedAlgorithm, context: RunContext):
        config = context.config
        self.algorithm = algorithm
        self.context = context
        self.options: SFTConfig = config.section(algorithm.config_section or algorithm.name)
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
        self.total_steps = planned_steps(self.options, len(self.train_loader))
        context.config = with_schedule_horizon(config, self.total_steps)
        self.loss_fn: LossFunction = context.build_loss(self.options.loss, self.options)
        self.policy: Policy | None = None
        self.plane: DataPlane | None = None
        self.step = 0
        self.saved_step: int | None = None
        self.validated_step: int | None = None
        self.validation: dict[str, float] = {}

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming when a checkpoint exists); return the last
        step's metrics plus the last validation's as ``validation/<name>``."""
        context, options = self.context, self.options
        save_period = context.config.checkpointing.save_period
        self.policy = context.build_policy()
        try:
            self.plane = context.build_data_plane()
            self.resume()
            if options.val_at_start and self.step == 0:
                self.validate()
            metrics: dict[str, float] = {}
            bar = context.progress(self.total_steps, self.algorithm.name, initial=self.step)
            batches = self._batches()
            try:
                while self.step < self.total_steps and not context.stop_requested:
                    metrics = self.train_step(*next(batches))
                    bar.update(metrics)
                    if options.val_period and self.step % options.val_period == 0:
                        self.validate()
                    if save_period and self.step % save_period == 0:
                        self.save(metrics)
            finally:
                bar.close()
            if options.val_at_end and self.validated_step != self.step and not context.stop_requested:
                self.validate()
            if self.step and self.saved_step != self.step:
                self.save(metrics)
            if options.export_dir and not context.stop_requested:
                self.policy.export_hf(options.export_dir)
                context.log.info("exported Hugging Face weights", path=options.export_dir, step=self.step)
            return {"step": self.step, **metrics, **{f"validation/{k}": v for k, v in self.validation.items()}}
        finally:
            if self.plane is not None:
                self.plane.shutdown()
            self.policy.shutdown()

    def _batches(self) -> Iterator[tuple[int, Batch]]:
        """``(epoch, global batch)`` from the loader's current position on, epoch after epoch."""
        while True:
            epoch = self.train_loader.epoch
            for batch in self.train_loader:
                yield epoch, batch

    def train_step(self, epoch: int, batch: Batch) -> dict[str, float]:
        """One optimizer step; logs and returns its metrics and advances ``step``. Besides the
        policy's metrics: ``step_time_s`` (wall time of the whole step, reference scoring
        included), ``total_tokens`` (prompt and answer), ``tokens_per_s`` and ``epoch``."""
        assert self.policy is not None
        start = time.perf_counter()
        metrics = self.train_through_plane(f"train/{self.step + 1}", batch)
        elapsed = time.perf_counter() - start
        tokens = int(batch["input_lengths"].sum())
        metrics.update(step_time_s=elapsed, total_tokens=tokens, tokens_per_s=tokens / elapsed, epoch=epoch)
        self.step += 1
        self.context.log_metrics(self.step, metrics, "train")
        return metrics

    def validate(self) -> dict[str, float]:
        """Loss and loss metrics over the validation set (or its first ``val_batches``
        batches), averaged as over one batch; logged with phase ``validation``."""
        if self.val_loader is None:
            return {}
        assert self.policy is not None
        start = time.perf_counter()
        multiple = self.context.config.policy.data_parallel_size * self.algorithm.rows_per_example
        parts: list[tuple[float, dict[str, float]]] = []
        for k, batch in enumerate(self.val_loader.epoch_batches(0)):
            if self.options.val_batches is not None and k >= self.options.val_batches:
                break
            batch = pad_rows(batch, multiple)
            weight = normaliser(batch, self.loss_fn)
            if weight > 0:
                parts.append((weight, self.train_through_plane(f"validation/{self.step}/{k}", batch, eval_mode=True)))
        metrics = weighted_metrics(parts, self.loss_fn.metric_reductions)
        metrics["time_s"] = time.perf_counter() - start
        self.validation, self.validated_step = metrics, self.step
        self.context.log_metrics(self.step, metrics, "validation")
        return metrics

    def train_through_plane(self, partition: str, batch: Batch, *, eval_mode: bool = False) -> dict[str, float]:
        """Put ``batch`` into ``partition`` of the data plane, let the algorithm add to it,
        train (or, with ``eval_mode``, evaluate) the policy on it from there; the partition
        is cleared afterwards, whatever happens."""
        assert self.policy is not None and self.plane is not None
        keys = [str(i) for i in range(len(batch))]
        self.plane.put(partition, keys, batch)
        try:
            samples = self.algorithm.prepare_batch(
                self.policy, PlaneSamples(self.plane, partition, keys, list(batch)), self.options
            )
            return self.policy.train_from(samples, self.loss_fn, eval_mode=eval_mode)
        finally:
            self.plane.clear(partition)

    # ------------------------------------------------------------------ checkpoints

    def save(self, metrics: Mapping[str, float]) -> None:
        """Checkpoint ``step`` (no-op when checkpointing is off)."""
        manager = self.context.checkpoints
        if manager is None:
            return
        assert self.policy is not None
        policy = self.policy

        def write(folder: Path) -> None:
            policy.save_checkpoint(str(folder / "policy"))
            torch.save(self.train_loader.state_dict(), folder / "dataloader.pt")
            torch.save(rng_state(), folder / "rng.pt")

        scored = {**metrics, **{f"validation/{k}": v for k, v in self.validation.items()}}
        manager.save(self.step, write, scored, dump_config(self.context.config))
        self.saved_step = self.step

    def resume(self) -> None:
        """Restore weights, optimizer, loader position, RNG and step from the latest
        checkpoint, when there is one and ``checkpointing.resume`` is on."""
        manager = self.context.checkpoints
        if manager is None or not self.context.config.checkpointing.resume:
            return
        latest = manager.latest()
        if latest is None:
            return
        assert self.policy is not None
        self.policy.load_checkpoint(str(latest / "policy"))
        self.train_loader.load_state_dict(torch.load(latest / "dataloader.pt"))
        set_rng_state(torch.load(latest / "rng.pt"))
        self.step = self.saved_step = int(manager.info(latest)["step"])
        self.context.log.info("resumed", checkpoint=str(latest), step=self.step, total_steps=self.total_steps)


# ---------------------------------------------------------------------- helpers


def planned_steps(options: SFTConfig, batches_per_epoch: int) -> int:
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


def weighted_metrics(
    parts: list[tuple[float, Mapping[str, float]]], reductions: Mapping[str, str]
) -> dict[str, float]:
    """Per-batch means combined into the mean over all batches (each weighted by its
    normaliser); names in ``reductions`` take their max/min; pass metrics are dropped."""
    total = sum(weight for weight, _ in parts)
    names = dict.fromkeys(name for _, part in parts for name in part if name not in _PASS_METRICS)
    out: dict[str, float] = {}
    for name in names:
        values = [(weight, part[name]) for weight, part in parts if name in part]
        if name in reductions:
            out[name] = float((max if reductions[name] == "max" else min)(v for _, v in values))
        else:
            out[name] = sum(weight * v for weight, v in values) / total
    return out
