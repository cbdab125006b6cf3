"""Generation backends: sample completions from token ids; receive new weights (refit).

Input batch: ``input_ids`` int64 [B, S] right-padded prompts, ``input_lengths`` int64 [B],
optionally ``stop_strings`` (list per sample, or None). No tokenizer crosses the boundary.

Output batch (same sample order):
- ``output_ids`` int64 [B, S'], prompt followed by generated tokens, right-padded;
- ``logprobs`` float32 [B, S'], the sampled tokens' logprobs (0 on prompt and padding);
- ``generation_lengths`` int64 [B]; ``unpadded_sequence_lengths`` int64 [B] (prompt + generated);
- ``truncated`` bool [B]: stopped by ``max_new_tokens`` (or the context limit), not by a stop;
- ``weight_versions`` int64 [B] (optional): the version of the weights that generated each
  row, the ``version`` of the last weight sync the engine loaded (0 before any). A backend
  whose engines take new weights while generation runs must give it: asynchronous training
  bounds how old a sample's weights may be by it;
- ``routed_experts`` int16 [B, S', layers, k] (when the run records routes, ``policy.moe``):
  the experts of a mixture of experts each token went through in the engine, -1 on tokens it
  did not run (the last generated token, padding); see :mod:`posttrain.backend.routing`.

Logprobs are those of the distribution actually sampled from, i.e. of logits divided by the
temperature, so that they are comparable with a trainer that scales logits the same way.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Protocol

import attrs

from posttrain.batch import Batch

#: The output (and rollout batch) field of per-token routes, :mod:`posttrain.backend.routing`.
ROUTES_FIELD = "routed_experts"


@attrs.frozen
class RefitStats:
    """How a weight refit went: wall seconds, bytes and tensors sent, buckets, the most bytes
    the sending rank staged at once (a gathered layer group plus one bucket) and the
    transport that carried them."""

    seconds: float
    bytes_moved: int
    num_tensors: int
    num_buckets: int
    peak_staging_bytes: int = 0
    transport: str = ""


class WeightEndpoint(Protocol):
    """Where a policy's ranks send their weights, worker to worker, as a generation
    backend describes it (:meth:`Generation.weight_endpoint`). Picklable and small (actor
    handles, a transport name): it travels from the driver to the policy's ranks, which call
    ``connect`` once (see :class:`posttrain.backend.weight_sync.BroadcastEndpoint`)."""

    def connect(self, source: Any, *, rank: int, bucket_bytes: int) -> Any: ...


class Generation(abc.ABC):
    """What every generation backend provides."""

    @abc.abstractmethod
    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        """Generate one completion per row; ``greedy`` forces argmax decoding (validation)."""

    @abc.abstractmethod
    def weight_endpoint(self) -> WeightEndpoint:
        """How the policy reaches the running engines to replace their weights without a
        restart (the same object on every call). The engines load full Hugging Face-named
        weights and drop every cache computed with the old ones; the bytes go from the
        policy's workers to the engines, never through the caller."""

    def set_sampling_seed(self, seed: int) -> None:
        """Sample from now on as a backend freshly built with run seed ``seed`` would.

        Algorithms call it before each step with a seed derived from the run's seed and the
        step, so what a step samples does not depend on the calls made before it (nor on
        the process: a resumed run samples what an uninterrupted one would). Default:
        nothing, for backends without seeded sampling.
        """

    def refit_window(self) -> contextlib.AbstractContextManager[None]:
        """Entered by :func:`posttrain.run.refit.refit` around a refit: a backend whose
        ``generate`` other threads call meanwhile may hold new calls until it ends, so the
        refit reaches the engines ahead of them. Default: nothing."""
        return contextlib.nullcontext()

    def prepare_for_generation(self) -> None:
        """Wake up / move weights onto the device before generating (idempotent)."""

    def finish_generation(self) -> None:
        """Release what generation holds (KV cache, device weights) when colocated."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engines. Safe to call twice."""
