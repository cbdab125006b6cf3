"""The policy-worker contract: what one rank of a sharded policy backend implements.

A policy backend built on the kit is a :class:`PolicyWorker` subclass (one rank: its shard
of the model, optimizer and schedule) plus a factory that starts a
:class:`~posttrain.distributed.WorkerGroup` of it and wraps the group in a
:class:`~posttrain.backend.policy_driver.ShardedPolicy`, which implements
:class:`~posttrain.interfaces.Policy` for algorithms: it plans each pass, sends every rank
its :class:`~posttrain.backend.work.RankWork` and reassembles the results. The driver calls
these methods, never others, and calls them on every rank unless a method says otherwise;
the ones marked *collective* may hold collectives, so every rank must take part.

Pass results: every rank returns one, but the driver keeps only the results of the ranks it
was told stand for each data-parallel replica (``result_ranks``); the others may return
None (e.g. pipeline stages before the last). Tensors returned are on CPU.

``posttrain.testing.PolicyContract`` checks a backend against a plain transformers reference.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch

from posttrain.backend.work import RankWork
from posttrain.batch import Batch
from posttrain.distributed import Worker
from posttrain.errors import CheckpointError
from posttrain.interfaces.loss import LossFunction


class RankTrainResult(TypedDict):
    """What :meth:`PolicyWorker.train` returns on a rank that stands for its replica.

    ``loss`` and every entry of ``metrics`` are this rank's contributions (the driver sums
    them over the replicas, or takes the max/min the loss's ``metric_reductions`` name);
    ``num_tokens`` is the global count of valid tokens, ``lr`` the learning rate the step
    used, ``grad_norm`` the global gradient norm before clipping (absent in eval mode),
    ``step_time_s`` the rank's wall time for the pass.
    """

    loss: float
    metrics: dict[str, float]
    num_tokens: float
    lr: float
    grad_norm: NotRequired[float]
    step_time_s: float


class PolicyWorker(Worker, abc.ABC):
    """One rank of a sharded policy. ``__init__`` (with whatever arguments the backend's
    factory passes) forms the process group from the rank variables the worker group sets,
    loads ``policy.model`` and builds the optimizer and schedule from ``config.policy``.

    Logprob convention and temperature: as in :mod:`posttrain.interfaces.policy`.
    """

    # ------------------------------------------------------------------ passes (collective)

    @abc.abstractmethod
    def logprobs(self, work: RankWork, reference: bool = False) -> Batch | None:
        """``logprobs`` float32 [n, S] of ``work.batch`` (n samples) under the current weights,
        or ``reference_logprobs`` under the frozen initial weights when ``reference``."""

    @abc.abstractmethod
    def topk(self, work: RankWork, k: int) -> Batch | None:
        """``topk_logits`` float32 and ``topk_indices`` int64 [n, S-1, k] of ``work.batch``:
        the raw (not temperature-scaled) top-``k`` logits at each position (predicting the
        next token), 0 at padding positions."""

    @abc.abstractmethod
    def train(self, work: RankWork, loss_fn: LossFunction, eval_mode: bool = False) -> RankTrainResult | None:
        """Forward and backward over ``work.microbatches`` of ``work.batch`` with ``loss_fn``
        (normalised by the global valid counts over the data-parallel ranks), then one
        optimizer and scheduler step (clipped to ``policy.max_grad_norm``); without a step
        and without gradients when ``eval_mode``. A rank that does not stand for its replica
        returns None or a dict with only ``step_time_s`` (and ``grad_norm``)."""

    # ------------------------------------------------------------------ state (collective)

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's weights, optimizer and scheduler state under folder ``path``."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, so that training continues exactly;
        raise :class:`~posttrain.errors.CheckpointError` naming what is missing (see
        :func:`require_policy_checkpoint`)."""

    @abc.abstractmethod
    def weight_sizes(self) -> list[tuple[str, int]]:
        """``(hugging_face_name, bytes)`` of every exported tensor, in export order, at the
        size :meth:`gather_weights` gives it. Called on rank 0 only."""

    @abc.abstractmethod
    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The named full (unsharded) tensors under Hugging Face names, on CPU in
        ``policy.dtype``, on rank 0; None on the other ranks."""

    @abc.abstractmethod
    def export_hf(self, path: str, shard_bytes: int) -> None:
        """Write a Hugging Face folder at ``path`` (safetensors shards of at most
        ``shard_bytes``, config, tokenizer) that transformers and vLLM load."""

    # ------------------------------------------------------------------ placement and facts

    def prepare_for_training(self) -> None:
        """Bring weights and optimizer state back onto the training device (colocated mode).
        The default does nothing (state that never leaves the device)."""

    def offload(self) -> None:
        """Move weights and optimizer state off the training device (colocated mode). The
        default does nothing."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """Static facts for logs: at least ``backend``, ``parameters`` (of the whole model),
        ``world_size``, ``device`` and ``dtype``. Called on rank 0 only."""


def require_policy_checkpoint(path: str, names: tuple[str, ...], backend: str) -> Path:
    """The folder ``path`` of a ``backend`` policy checkpoint, after checking that it holds
    every entry in ``names``; raises :class:`CheckpointError` naming the missing ones."""
    folder = Path(path)
    missing = [name for name in names if not (folder / name).exists()]
    if missing:
        raise CheckpointError(
            f"policy checkpoint '{path}' is incomplete or not a {backend} policy checkpoint: missing "
            f"{', '.join(missing)} (expected a folder written by save_checkpoint)"
        )
    return folder
