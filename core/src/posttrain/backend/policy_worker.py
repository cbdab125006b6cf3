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

``posttrain.testing.PolicyContract`` checks a backend against a plain transformers reference;
``examples/plugins/posttrain-policy-torch`` is a complete single-process backend written
from this page.

Writing the factory (registered with ``posttrain_policy_backends``, called as
``factory(config, cluster, name=...)``): start ``WorkerGroup(cluster, YourWorker, name=name,
num_workers=config.policy.num_workers, resources=config.policy.resources, args=(config,
...))`` (the group's name names its placement group; ``"policy"`` is the policy's, a second
model of the run such as a critic or a teacher has its own) and return
``ShardedPolicy(config, group, dp_rank_of, result_ranks)``. By then the run has
filled ``policy.scheduler.total_steps`` (the run's optimizer steps) when the user left it
unset, so :func:`posttrain.backend.lr_schedule.build_scheduler` can be called as is. The
worker computes on CUDA when its actor was given a GPU
(:func:`posttrain.distributed.placement.uses_cuda`, which raises when torch cannot see the
GPU Ray gave), on the CPU otherwise.

Computing logprobs: :func:`posttrain.backend.logprobs.sequence_logprobs` takes the model's
final hidden states (after the final norm; for a transformers causal LM,
``model.model(...).last_hidden_state``) and the output embedding
(``model.get_output_embeddings().weight``), so the ``[tokens, vocabulary]`` logits never
exist whole. ``work.batching`` says how the driver grouped each microbatch: with
``packing_tokens_per_row`` it planned packed rows (:class:`posttrain.batch.PackedRows`);
a backend may run every microbatch as right-padded rows instead (same numbers, more
padding). Planned microbatches are never empty.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar, NotRequired, TypedDict

import torch

from posttrain.backend.weight_sync import BroadcastEndpoint, GatheredWeights, ParamMeta, SendStats, WeightSender
from posttrain.backend.work import RankWork, ShardRef
from posttrain.batch import Batch
from posttrain.distributed import Worker
from posttrain.errors import CheckpointError
from posttrain.interfaces.data_plane import SampleMap
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
    loads ``policy.model`` (with the head ``policy.head`` names) and builds the optimizer and
    schedule from ``config.policy``.

    Logprob convention, temperature and value heads: as in :mod:`posttrain.interfaces.policy`.
    """

    #: The inputs :meth:`train` computes for losses (:attr:`~posttrain.interfaces.LossFunction.input_type`):
    #: ``"logprobs"``, ``"topk_logprobs"`` (language-model head) and ``"values"`` (value head;
    #: then :meth:`values` is implemented too). :class:`~posttrain.backend.policy_driver.ShardedPolicy`
    #: refuses a ``policy.head`` whose input is not listed, and a loss whose input is not.
    loss_inputs: ClassVar[tuple[str, ...]] = ("logprobs",)

    # ------------------------------------------------------------------ passes (collective)

    @abc.abstractmethod
    def logprobs(self, work: RankWork, reference: bool = False) -> Batch | None:
        """``logprobs`` float32 [n, S] of ``work.batch`` (n samples) under the current weights,
        or ``reference_logprobs`` under the frozen initial weights when ``reference`` (under
        ``policy.lora``: the base model, adapters off)."""

    def values(self, work: RankWork) -> Batch | None:
        """``values`` float32 [n, S] of ``work.batch`` under the current weights (a value head:
        see :mod:`posttrain.interfaces.policy`). Only for backends whose :attr:`loss_inputs`
        list ``"values"``."""
        raise NotImplementedError(f"{type(self).__name__} has no value head")

    @abc.abstractmethod
    def topk(self, work: RankWork, k: int) -> Batch | None:
        """``topk_logits`` float32 and ``topk_indices`` int64 [n, S-1, k] of ``work.batch``:
        the raw (not temperature-scaled) top-``k`` logits at each position (predicting the
        next token), 0 at padding positions; optionally ``topk_logprobs`` float32 [n, S-1, k],
        the same ids' logprobs at the logprob temperature (what distillation needs;
        :func:`posttrain.backend.logprobs.logsumexp_logits` gives the normaliser)."""

    @abc.abstractmethod
    def train(self, work: RankWork, loss_fn: LossFunction, eval_mode: bool = False) -> RankTrainResult | None:
        """Forward and backward over ``work.microbatches`` of ``work.batch`` with ``loss_fn``
        (normalised by the global valid counts over the data-parallel ranks), then one
        optimizer and scheduler step (clipped to ``policy.max_grad_norm``); without a step
        and without gradients when ``eval_mode``. The model runs in training mode (dropout
        on) unless ``eval_mode``; the reported ``lr`` is the one the step used (read before
        the scheduler steps). A rank that does not stand for its replica returns None or a
        dict with only ``step_time_s`` (and ``grad_norm``)."""

    def map_shard(self, shard: ShardRef, fn: SampleMap, writers: list[int]) -> dict[str, float] | None:
        """Map this replica's ``shard`` with ``fn`` in place in the plane (:meth:`ShardRef.map`)
        and return the sums, on the rank of ``writers`` (one per replica); None on the other
        ranks. Not collective, and backends need not override it."""
        return shard.map(fn) if self.rank in writers else None

    # ------------------------------------------------------------------ state (collective)

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's weights, optimizer and scheduler state (and step counter) under
        folder ``path``, creating it."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, so that training continues exactly;
        raise :class:`~posttrain.errors.CheckpointError` naming what is missing (see
        :func:`require_policy_checkpoint`)."""

    @abc.abstractmethod
    def weight_metadata(self) -> list[ParamMeta]:
        """Name, full shape and dtype of every exported tensor, in export order, as
        :meth:`gather_weights` gives them (without gathering anything). The names are those
        of the Hugging Face model's ``named_parameters()`` (each tensor once: an output
        embedding tied to the input embedding is not repeated). Called on every rank."""

    def weight_sizes(self) -> list[tuple[str, int]]:
        """``(hugging_face_name, bytes)`` of every exported tensor, from :meth:`weight_metadata`."""
        return [(meta.name, meta.nbytes) for meta in self.weight_metadata()]

    @abc.abstractmethod
    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The named full (unsharded) tensors under Hugging Face names, on CPU in
        ``policy.dtype``, on rank 0; None on the other ranks."""

    def gather_sync_weights(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """:meth:`gather_weights` for a weight sync, which copies them into its buffers at
        once: the default gives the same CPU tensors; a backend training on a GPU may leave
        them on its device (no trip through CPU memory on the way to engines on GPUs)."""
        return self.gather_weights(names)

    @abc.abstractmethod
    def export_hf(self, path: str, shard_bytes: int) -> None:
        """Write a Hugging Face folder at ``path`` (safetensors shards of at most
        ``shard_bytes``, the model's config and generation config, and the tokenizer of
        ``policy.tokenizer`` or else ``policy.model``) that transformers and vLLM load;
        :mod:`posttrain.backend.hf_export` writes the shards and the metadata. A backend
        that supports ``policy.lora`` writes the adapters there as a PEFT folder instead
        (:func:`posttrain.backend.adapter_folder.write_adapter_folder`), and the merged model
        in its ``merged/`` folder when ``policy.lora.export_merged``."""

    # ------------------------------------------------------------------ weight sync (collective)

    def connect_weights(self, endpoint: BroadcastEndpoint, bucket_bytes: int) -> None:
        """Join the weight sync with a generation backend's engines (rank 0 opens the group;
        see :mod:`posttrain.backend.weight_sync`). Backends need not override it: it runs on
        :meth:`weight_metadata` and :meth:`gather_sync_weights`."""
        source = GatheredWeights(self.weight_metadata(), self.gather_sync_weights)
        self._weight_sender = endpoint.connect(source, rank=self.rank, bucket_bytes=bucket_bytes)

    def send_weights(self, version: int) -> SendStats | None:
        """Broadcast the current weights to the connected engines under ``version``, one
        layer group at a time; rank 0 returns what it sent, the others None."""
        sender: WeightSender | None = getattr(self, "_weight_sender", None)
        if sender is None:
            raise RuntimeError("send_weights() before connect_weights(): the weight sync is not connected")
        return sender.send(version)

    # ------------------------------------------------------------------ placement and facts

    def prepare_for_training(self) -> None:
        """Bring weights and optimizer state back onto the training device (colocated mode).
        The default does nothing (state that never leaves the device)."""

    def offload(self) -> None:
        """Move weights and optimizer state off the training device (colocated mode). The
        default does nothing."""

    def onload_weights(self) -> None:
        """Bring the weights alone back onto the training device, for gathers and exports of
        an offloaded policy (the driver offloads it again after them); backends that can leave
        the optimizer state off the device meanwhile do (it is the larger part: Adam's two
        moments). The default brings everything: :meth:`prepare_for_training`."""
        self.prepare_for_training()

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
