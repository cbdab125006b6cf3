"""Refit: copy the policy's current weights into the generation engines.

The policy yields its full Hugging Face-named weights in buckets of at most
``bucket_bytes`` (:meth:`Policy.export_weights`); the generation backend loads them bucket
by bucket while the next one is produced (:meth:`Generation.update_weights`), so at most a
couple of buckets exist outside the models at any time. The backend wakes whatever it
needs for loading itself; call :meth:`Generation.prepare_for_generation` before the next
``generate`` as usual.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from posttrain.interfaces.generation import Generation, RefitStats
from posttrain.interfaces.policy import Policy


def refit(policy: Policy, generation: Generation, bucket_bytes: int) -> RefitStats:
    """Stream ``policy``'s weights into ``generation``; return what moved and how long it took.

    ``seconds`` is the wall time of the whole transfer (export, transport and load);
    ``bytes_moved`` is the sum of ``nbytes`` over every tensor the policy yielded.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"refit bucket_bytes must be positive (generation.refit_bucket_bytes), got {bucket_bytes}")
    tally = _Tally()
    start = time.perf_counter()
    generation.update_weights(tally.count(policy.export_weights(bucket_bytes)))
    return RefitStats(
        seconds=time.perf_counter() - start,
        bytes_moved=tally.bytes,
        num_tensors=tally.tensors,
        num_buckets=tally.buckets,
    )


class _Tally:
    """Counts the buckets, tensors and bytes that pass through :meth:`count`."""

    def __init__(self) -> None:
        self.bytes = self.tensors = self.buckets = 0

    def count(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[Mapping[str, torch.Tensor]]:
        for bucket in buckets:
            self.buckets += 1
            self.tensors += len(bucket)
            self.bytes += sum(t.numel() * t.element_size() for t in bucket.values())
            yield bucket
