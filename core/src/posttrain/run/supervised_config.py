"""The options every supervised algorithm's section shares (``sft``, ``dpo``, and the
algorithms to come that train on a fixed dataset), and their checks. Imports only attrs: a
plugin module declaring its section stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from posttrain.config.demands import Demand
    from posttrain.config.schema import RunConfig


@attrs.define
class SupervisedConfig:
    """Options of the supervised loop (:mod:`posttrain.run.supervised`). Steps are optimizer
    steps over ``policy.train_global_batch_size`` rows; training stops at whichever of
    ``max_num_steps`` and ``max_num_epochs`` comes first. An algorithm's section subclasses
    this and adds ``loss`` with its default and its loss options."""

    max_num_steps: int | None = None  # optimizer steps at most; None: stop after max_num_epochs
    max_num_epochs: int = 1  # passes over the training data, unless max_num_steps ends the run first
    val_period: int = 0  # steps between validation passes; 0: none during training
    val_batches: int | None = None  # batches per validation pass; None: the whole validation set
    val_global_batch_size: int | None = None  # rows per validation batch; None: policy.train_global_batch_size
    val_at_start: bool = False  # validate before the first step (fresh runs, not resumed ones)
    val_at_end: bool = True  # validate after the last step (unless it was just validated or the run was stopped)
    export_dir: str | None = None  # write a Hugging Face folder of the final weights here
    loss: str = attrs.field(kw_only=True)  # a name in the loss registry; each section gives its default

    def cluster_demands(self, config: RunConfig) -> list[Demand]:
        """The policy's workers (:mod:`posttrain.config.demands`)."""
        from posttrain.config.demands import policy_demand

        return [policy_demand(config.policy)]


def check_supervised_config(section: str, options: SupervisedConfig) -> list[str]:
    """Problems with the loop options of section ``section``, each as
    ``"<section>.<key>: expected ..., found ..."``."""
    problems = []
    if options.max_num_steps is not None and options.max_num_steps < 1:
        problems.append(f"{section}.max_num_steps: expected a positive number or null, found {options.max_num_steps}")
    if options.max_num_epochs < 1:
        problems.append(f"{section}.max_num_epochs: expected at least 1, found {options.max_num_epochs}")
    if options.val_period < 0:
        problems.append(f"{section}.val_period: expected 0 (off) or a positive step count, found {options.val_period}")
    for key in ("val_batches", "val_global_batch_size"):
        value = getattr(options, key)
        if value is not None and value < 1:
            problems.append(f"{section}.{key}: expected a positive number or null, found {value}")
    return problems
