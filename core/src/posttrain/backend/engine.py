"""What a generation engine is asked and answers: :class:`GenerationRequest` in,
:class:`Completion` out, and :class:`EngineWorker`, the methods every engine actor provides
(driven by :class:`~posttrain.backend.generation_group.WorkerGroupGeneration`, or hosted in the
policy's workers by :mod:`posttrain.backend.hosted`)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs
import torch

from posttrain.backend.weight_sync import ParamMeta, TransferInit
from posttrain.distributed.worker_group import Worker


@attrs.frozen
class GenerationRequest:
    """One engine's share of a ``generate`` call. Lists are per row, in batch order.

    ``temperature == 0`` means greedy. ``max_new_tokens[i]`` is already capped so that the
    prompt plus the completion fits the engine's context. ``stop_token_ids`` includes the
    model's EOS ids.
    """

    prompts: list[list[int]]
    seeds: list[int]
    max_new_tokens: list[int]
    stop_strings: list[list[str]]
    stop_token_ids: list[int]
    temperature: float
    top_p: float
    top_k: int | None
    #: A vision-language model's prompt images, per row: pixel values and its family's grids
    #: [images, 3] (:data:`~posttrain.data.images.PIXEL_ROWS`; no rows for a text prompt); None
    #: when no prompt has images.
    images: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    #: The same images per row as encoded files, for an engine whose own processor reads them
    #: (vLLM); None when the batch did not carry them.
    encoded_images: list[list[bytes]] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, start: int, stop: int) -> GenerationRequest:
        """Rows ``start:stop`` of this request."""
        return attrs.evolve(
            self,
            prompts=self.prompts[start:stop],
            seeds=self.seeds[start:stop],
            max_new_tokens=self.max_new_tokens[start:stop],
            stop_strings=self.stop_strings[start:stop],
            images=self.images[start:stop] if self.images is not None else None,
            encoded_images=self.encoded_images[start:stop] if self.encoded_images is not None else None,
        )


@attrs.frozen
class Completion:
    """The generated tokens of one row (stop token or stop string included), the logprob
    of each under the distribution it was sampled from, and whether it ran out of budget.
    An engine asked to record routes (``policy.moe``) adds ``routed_experts``: int16 [n,
    layers, k], the experts of the row's first n tokens, prompt then completion, as the engine
    ran them (:mod:`posttrain.backend.routing`)."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool
    routed_experts: torch.Tensor | None = None


class EngineWorker(Worker, abc.ABC):
    """The methods :class:`~posttrain.backend.generation_group.WorkerGroupGeneration` calls on every engine actor.

    ``weight_version`` is the version of the weights the engine holds: 0 as loaded from the
    model folder, then the ``version`` of each :meth:`receive_weights`."""

    weight_version: int = 0

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> list[Completion]:
        """Complete every row of ``request`` (possibly none), in order."""

    def generate_with_version(self, request: GenerationRequest) -> tuple[int, list[Completion]]:
        """:meth:`generate`, with the version of the weights that generated it (an engine
        takes one call at a time, so a weight sync lands before or after it, never inside)."""
        return self.weight_version, self.generate(request)

    @abc.abstractmethod
    def init_weight_transfer(self, init: TransferInit) -> None:
        """Join the weight-sync group that policy rank 0 opens (ranks ``init.rank_offset``
        onwards, one per rank the engine declared; see :mod:`posttrain.backend.weight_sync`)
        and keep ``init.plan``. Called again when the policy reconnects: leave the old group."""

    @abc.abstractmethod
    def receive_weights(self, version: int) -> list[str]:
        """Receive one weight sync (the plan's buckets, broadcast by policy rank 0), load it
        in place of the current weights, drop every cache computed with the old ones and
        set :attr:`weight_version` to ``version``; return the names of the model's parameters
        the sync did not cover (none, when the models match). Weights asleep are woken first."""

    def check_weights(self, metas: Sequence[ParamMeta]) -> None:
        """Raise :class:`~posttrain.errors.WorkerError` unless a sync of ``metas`` (names,
        full shapes, dtypes) would replace every weight of the model: for an engine hosted in
        the policy's workers (:mod:`posttrain.backend.hosted`), before its first load."""
        raise NotImplementedError(f"{type(self).__name__} cannot run in the policy's workers")

    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy full Hugging Face-named ``tensors`` (a layer group) into the model, in place,
        dropping every cache computed with the old weights: for an engine hosted in the
        policy's workers. The tensors belong to the caller: copy, keep no reference."""
        raise NotImplementedError(f"{type(self).__name__} cannot run in the policy's workers")

    def share_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """:meth:`load_weights` for an engine hosted in the policy's workers, given tensors it
        may keep instead of copying: the policy's own parameters (which a policy on one rank
        in the engine's dtype gathers without a copy) or full tensors gathered for this call.
        A kept tensor changes as the policy trains, which a hosted engine allows: it generates
        only between refits (synchronous runs). Default: :meth:`load_weights`."""
        self.load_weights(tensors)

    def close(self) -> None:
        """Release what the engine keeps outside its process (files), before its actor is
        stopped, which runs no finalizer; default: nothing."""

    def sleep(self) -> None:
        """Release device memory between generations (colocated mode); default: nothing."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (idempotent); default: nothing."""
