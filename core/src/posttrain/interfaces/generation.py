"""Generation backends: sample completions from token ids; receive new weights (refit).

Input batch: ``input_ids`` int64 [B, S] right-padded prompts, ``input_lengths`` int64 [B],
optionally ``stop_strings`` (list per sample, or None). No tokenizer crosses the boundary.

Output batch (same sample order):
- ``output_ids`` int64 [B, S'], prompt followed by generated tokens, right-padded;
- ``logprobs`` float32 [B, S'], the sampled tokens' logprobs (0 on prompt and padding);
- ``generation_lengths`` int64 [B]; ``unpadded_sequence_lengths`` int64 [B] (prompt + generated);
- ``truncated`` bool [B]: stopped by ``max_new_tokens`` (or the context limit), not by a stop.

Logprobs are those of the distribution actually sampled from, i.e. of logits divided by the
temperature, so that they are comparable with a trainer that scales logits the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping

import attrs
import torch

from posttrain.batch import Batch


@attrs.frozen
class RefitStats:
    """How a weight refit went."""

    seconds: float
    bytes_moved: int
    num_tensors: int
    num_buckets: int


class Generation(abc.ABC):
    """What every generation backend provides."""

    @abc.abstractmethod
    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        """Generate one completion per row; ``greedy`` forces argmax decoding (validation)."""

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> RefitStats:
        """Load full Hugging Face-named weights into the running engines without restart,
        bucket by bucket, and drop every cache computed with the old weights."""

    def set_sampling_seed(self, seed: int) -> None:
        """Sample from now on as a backend freshly built with run seed ``seed`` would.

        Algorithms call it before each step with a seed derived from the run's seed and the
        step, so what a step samples does not depend on the calls made before it (nor on
        the process: a resumed run samples what an uninterrupted one would). Default:
        nothing, for backends without seeded sampling.
        """

    def prepare_for_generation(self) -> None:
        """Wake up / move weights onto the device before generating (idempotent)."""

    def finish_generation(self) -> None:
        """Release what generation holds (KV cache, device weights) when colocated."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engines. Safe to call twice."""
