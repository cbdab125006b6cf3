"""Refit: replace the generation engines' weights with the policy's current ones.

The weights go from the policy's workers to the engines directly
(:mod:`posttrain.backend.weight_sync`): this process only says when, and under which
version. The backend wakes whatever it needs for loading itself; call
:meth:`Generation.prepare_for_generation` before the next ``generate`` as usual.
"""

from __future__ import annotations

from posttrain.interfaces.generation import Generation, RefitStats
from posttrain.interfaces.policy import Policy


def refit(policy: Policy, generation: Generation, bucket_bytes: int, version: int = 0) -> RefitStats:
    """Send ``policy``'s weights to ``generation``'s engines under ``version`` (the training
    step); return what moved and how long it took (export, transport and load). Inside the
    backend's :meth:`~posttrain.interfaces.Generation.refit_window`: a generate call another
    thread makes meanwhile starts after it."""
    if bucket_bytes <= 0:
        raise ValueError(f"refit bucket_bytes must be positive (generation.refit_bucket_bytes), got {bucket_bytes}")
    with generation.refit_window():
        return policy.send_weights(generation.weight_endpoint(), bucket_bytes, version)
