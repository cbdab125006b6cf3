"""refit(): streams the policy's buckets into the generation backend as they are produced
and reports the wall time and exactly what moved."""

from __future__ import annotations

import pytest
import torch

from posttrain.interfaces.generation import Generation, RefitStats
from posttrain.run.refit import refit
from posttrain.testing.generation import weight_buckets

WEIGHTS = {
    "embed.weight": torch.randn(7, 5),
    "layer.q.weight": torch.randn(5, 5, dtype=torch.bfloat16),
    "layer.k.weight": torch.randn(3, 5, dtype=torch.float64),
    "layer.count": torch.arange(4),  # int64
    "head.weight": torch.randn(7, 5),
}


class Source:
    """A policy's export_weights, logging when each bucket is produced."""

    def __init__(self, events):
        self.events = events

    def export_weights(self, bucket_bytes):
        for index, bucket in enumerate(weight_buckets(WEIGHTS, bucket_bytes)):
            self.events.append(("exported", index))
            yield bucket


class Receiver(Generation):
    """A generation backend that keeps what it is sent, logging when each bucket arrives."""

    def __init__(self, events):
        self.events = events
        self.received: dict[str, torch.Tensor] = {}

    def update_weights(self, buckets):
        for index, bucket in enumerate(buckets):
            self.events.append(("loaded", index))
            self.received.update(bucket)
        return RefitStats(0.0, 0, 0, 0)

    def generate(self, batch, *, greedy=False):
        raise AssertionError("refit must not generate")

    def shutdown(self):
        pass


def test_refit_streams_and_counts_every_byte():
    events: list[tuple[str, int]] = []
    receiver = Receiver(events)
    stats = refit(Source(events), receiver, bucket_bytes=150)
    expected_buckets = list(weight_buckets(WEIGHTS, 150))
    assert len(expected_buckets) > 2
    assert stats.bytes_moved == sum(t.nbytes for t in WEIGHTS.values()) == 140 + 50 + 120 + 32 + 140
    assert stats.num_tensors == len(WEIGHTS) and stats.num_buckets == len(expected_buckets)
    assert stats.seconds > 0
    assert receiver.received.keys() == WEIGHTS.keys()
    for name, tensor in WEIGHTS.items():
        assert torch.equal(receiver.received[name], tensor) and receiver.received[name].dtype == tensor.dtype
    # Bucket k is loaded before bucket k+1 is exported: nothing is materialised ahead.
    assert events == [(kind, i) for i in range(len(expected_buckets)) for kind in ("exported", "loaded")]


def test_refit_refuses_a_non_positive_bucket_size():
    with pytest.raises(ValueError, match=r"bucket_bytes must be positive \(generation.refit_bucket_bytes\), got 0"):
        refit(Source([]), Receiver([]), bucket_bytes=0)
