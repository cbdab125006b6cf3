"""The policy: the model being trained, usually sharded over a worker group.

Batch fields a policy reads (all on CPU, first dimension = samples):

- ``input_ids`` int64 [B, S], right-padded; ``input_lengths`` int64 [B].
- ``token_mask`` float32 [B, S]: 1 where a token carries loss (generated/assistant tokens).
- ``sample_mask`` float32 [B]: 0 drops a whole sample from the loss.
- whatever the loss function needs (advantages, prev_logprobs, ...).

Logprob convention: ``logprobs[:, t] = log p(x_t | x_<t)`` for ``1 <= t < length``; position 0,
padding, and (when ``token_mask`` is present) masked positions hold 0.

Temperature: ``p = softmax(logits / T)`` with ``T = posttrain.backend.sampling.logprob_temperature(
config.generation.temperature)`` (the generation temperature; 1 when it is 0, greedy), in
:meth:`Policy.get_logprobs`, :meth:`Policy.get_reference_policy_logprobs` and the logprobs
:meth:`Policy.train` passes to the loss, so they are comparable with the sampled tokens'
logprobs a generation backend reports. :meth:`Policy.get_topk_logits` returns raw logits.

Value head (``policy.head: value``): the model ends in a linear layer giving one scalar per
position (a Hugging Face ``*ForSequenceClassification`` with one label) instead of the
language-model head: reward models and critics. ``values[:, t]`` is the head's output on the
final hidden state of position ``t`` (having read ``x_0 .. x_t``) for ``0 <= t < length``, 0 on
padding; a sequence's score is its value at ``length - 1``, the position a Hugging Face
sequence classifier pools. :meth:`Policy.get_values` returns them and :meth:`Policy.train`
passes them to a loss whose ``input_type`` is ``"values"``; :meth:`Policy.export_hf` writes
a sequence-classification folder. A backend without value heads refuses ``policy.head:
value`` when it starts.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from posttrain.batch import Batch
from posttrain.interfaces.data_plane import PlaneSamples, SampleMap
from posttrain.interfaces.generation import ROUTES_FIELD, RefitStats, WeightEndpoint
from posttrain.interfaces.loss import LossFunction


class Policy(abc.ABC):
    """What every policy backend provides to algorithms."""

    @abc.abstractmethod
    def get_logprobs(self, batch: Batch) -> Batch:
        """Per-token logprobs of ``batch['input_ids']`` under the current weights.

        Returns a batch with ``logprobs`` float32 [B, S] in the convention above. Must not
        materialise a full [B, S, vocab] float32 tensor (chunk over the vocabulary). With
        ``policy.moe.routing_replay: previous`` it also returns ``routed_experts`` int16 [B, S,
        layers, k]: the experts its routers chose for each token in this pass, which later
        passes given the field replay.
        """

    @abc.abstractmethod
    def get_reference_policy_logprobs(self, batch: Batch) -> Batch:
        """Like :meth:`get_logprobs`, under the frozen initial weights; returns
        ``reference_logprobs``. The reference weights live on CPU and are swapped in for the
        pass, not kept as a second resident model; with ``policy.lora``, the reference is the
        base model with the adapters off (no copy at all)."""

    def get_values(self, batch: Batch) -> Batch:
        """A value-head policy's ``values`` float32 [B, S] of ``batch['input_ids']`` under the
        current weights (see the module docstring). Default: refused, for backends without
        value heads."""
        raise NotImplementedError(f"{type(self).__name__} has no value head (policy.head: value)")

    @abc.abstractmethod
    def get_topk_logits(self, batch: Batch, k: int) -> Batch:
        """Top-``k`` logits per next-token position: ``topk_logits`` float32 [B, S-1, k] and
        ``topk_indices`` int64 [B, S-1, k] (global vocabulary ids); a backend that computes
        them adds ``topk_logprobs`` float32 [B, S-1, k], those ids' logprobs at the logprob
        temperature (normalised over the whole vocabulary, so their tail mass is known)."""

    @abc.abstractmethod
    def train(self, batch: Batch, loss_fn: LossFunction, *, eval_mode: bool = False) -> dict[str, float]:
        """One optimizer step over the global batch ``batch`` (no step when ``eval_mode``).

        The loss is normalised by the global count of valid tokens or sequences, so
        gradient accumulation over microbatches equals one full-batch step. Groups of
        ``loss_fn.row_group_size`` consecutive rows stay together, in order, in one
        microbatch on one data-parallel rank. Returns scalar
        metrics: ``loss``, ``grad_norm``, ``lr``, ``num_tokens``, ``step_time_s`` and the
        loss function's own metrics (each summed over microbatches and ranks).
        """

    def logprobs_into(self, samples: PlaneSamples, field: str, *, reference: bool = False) -> None:
        """Write the logprobs of ``samples`` (current weights, or the reference weights when
        ``reference``) into their data plane as ``field``; ``samples.fields`` name the inputs.

        Equal to :meth:`get_logprobs` / :meth:`get_reference_policy_logprobs` on
        ``samples.get()``, then a put: this default does exactly that in the calling process.
        Where :meth:`get_logprobs` also gives ``routed_experts`` (``policy.moe.routing_replay:
        previous``), they are written beside ``field``.
        A policy whose workers can reach the plane (:meth:`~posttrain.interfaces.DataPlane.worker_handle`)
        may let them fetch their shards and write the results themselves.
        """
        batch = samples.get()
        if reference:
            samples.put({field: self.get_reference_policy_logprobs(batch)["reference_logprobs"]})
            return
        result = self.get_logprobs(batch)
        samples.put({field: result["logprobs"], **({ROUTES_FIELD: result[ROUTES_FIELD]} if ROUTES_FIELD in result else {})})

    def values_into(self, samples: PlaneSamples, field: str) -> None:
        """Write the values of ``samples`` (:meth:`get_values`) into their data plane as
        ``field``; ``samples.fields`` name the inputs. This default runs :meth:`get_values` on
        ``samples.get()`` in the calling process, then puts; a policy whose workers can reach
        the plane lets them write their shards themselves."""
        samples.put({field: self.get_values(samples.get())["values"]})

    def topk_into(self, samples: PlaneSamples, k: int, fields: Mapping[str, str]) -> None:
        """Write the top-``k`` pass of ``samples`` (:meth:`get_topk_logits`) into their data
        plane: ``fields`` maps each plane field to the result field it gets (e.g.
        ``{"teacher_topk_logprobs": "topk_logprobs"}``). This default runs
        :meth:`get_topk_logits` on ``samples.get()`` in the calling process, then puts; a policy
        whose workers can reach the plane lets them write their shards themselves."""
        result = self.get_topk_logits(samples.get(), k)
        missing = [source for source in fields.values() if source not in result]
        if missing:
            raise KeyError(f"{type(self).__name__}.get_topk_logits gives no {', '.join(missing)}")
        samples.put({field: result[source] for field, source in fields.items()})

    def map_into(self, samples: PlaneSamples, fn: SampleMap) -> dict[str, float]:
        """Apply the per-sample ``fn`` to ``samples`` (read as ``samples.fields``), write the
        fields it returns into their data plane, and return its sums added over the samples
        (no per-token tensor comes back). This default runs ``fn`` on ``samples.get()`` in the
        calling process, then puts; a policy whose workers can reach the plane lets each of
        them map its own shard, and adds their sums."""
        fields, sums = fn(samples.get())
        samples.put(fields)
        return dict(sums)

    def train_from(self, samples: PlaneSamples, loss_fn: LossFunction, *, eval_mode: bool = False) -> dict[str, float]:
        """:meth:`train` on ``samples.get()``; a policy whose workers can reach the plane may let
        them fetch their own shards instead (same result)."""
        return self.train(samples.get(), loss_fn, eval_mode=eval_mode)

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write weights, optimizer and scheduler state under folder ``path`` (created)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, so training continues exactly."""

    @abc.abstractmethod
    def export_hf(self, path: str) -> None:
        """Write a consolidated Hugging Face folder (safetensors, config, tokenizer). With
        ``policy.lora``: the adapters as a PEFT folder
        (:mod:`posttrain.backend.adapter_folder`) and, with ``policy.lora.export_merged``, the
        merged model as a Hugging Face folder in its ``merged/`` folder."""

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the full (unsharded) weights under Hugging Face names, in buckets of at
        most ``bucket_bytes`` bytes each (a single tensor larger than that is its own
        bucket), to the caller: for checks and tools. Refit uses :meth:`send_weights`."""

    @abc.abstractmethod
    def send_weights(self, endpoint: WeightEndpoint, bucket_bytes: int, version: int) -> RefitStats:
        """Replace the generation engines' weights with the current ones, worker to worker
        (no tensor reaches the caller), in buckets of at most ``bucket_bytes``; ``version``
        names the weights (the training step). Connects to ``endpoint`` on first use."""

    def host_engines(self, engine_cls: type, kwargs: Mapping[str, Any], name: str) -> Any:
        """Build one generation engine, ``engine_cls(**kwargs)``, in each of this policy's
        worker processes, under ``name``, and return the group that reaches them
        (``generation.in_policy_workers``; a
        :class:`~posttrain.backend.hosted.HostedGroup` for policies run by a worker group).
        The default refuses: the backend has no worker processes to host them."""
        from posttrain.errors import ConfigError

        raise ConfigError(
            f"generation.in_policy_workers is true, but this policy ({type(self).__name__}) cannot host generation "
            "engines in its workers; set generation.in_policy_workers: false"
        )

    def prepare_for_training(self) -> None:
        """Bring weights and optimizer state back onto the training device (colocated mode)."""

    def offload(self) -> None:
        """Move weights and optimizer state off the training device (colocated mode). Until
        :meth:`prepare_for_training`, forward and training passes raise; :meth:`export_hf`,
        :meth:`export_weights` and :meth:`send_weights` bring the state back for their
        duration and leave it offloaded; checkpoints are written from where it is."""

    def info(self) -> dict[str, Any]:
        """Static facts for logs: parameter count, world size, parallel layout."""
        return {}

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources. Safe to call twice."""
