"""Checkpoint and resume with real optimizer state: AdamW, cosine schedule with warmup and
gradient clipping, over four steps on different batches.

An uninterrupted two-rank run saves a sharded checkpoint after step 2. Reloading it (into the
same workers after they moved on, and into a fresh one-rank policy, which reshards the
checkpoint and starts with empty optimizer state) and running steps 3 and 4 again must give
the uninterrupted run's losses, learning rates and weights.
"""

from __future__ import annotations

import math

import pytest

from posttrain.config.schema import OptimizerConfig, SchedulerConfig
from posttrain.plugins import plugin_host
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray


def _config(dt, tiny_model_path, num_workers: int):
    return dt.policy_config(
        tiny_model_path,
        num_workers=num_workers,
        train_micro_batch_size=2,
        optimizer=OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.1),
        scheduler=SchedulerConfig(name="cosine", warmup_steps=2, total_steps=5, min_lr_ratio=0.1),
        max_grad_norm=0.5,  # below the tiny model's gradient norm (about 3): clipping is active
    )


def _steps(policy, batches, nll):
    return [policy.train(b, nll) for b in batches]


def test_resumed_runs_continue_exactly(tiny_model_path, virtual_cluster, dt, tmp_path):
    batches = [dt.make_batch(seed=s) for s in range(4)]
    ckpt = str(tmp_path / "step_2")
    policy = DTensorPolicy(_config(dt, tiny_model_path, 2), virtual_cluster, name="policy-resume")
    try:
        first = _steps(policy, batches[:2], dt.nll)
        policy.save_checkpoint(ckpt)
        uninterrupted = _steps(policy, batches[2:], dt.nll)
        final = dt.full_weights(policy)

        policy.load_checkpoint(ckpt)
        again = _steps(policy, batches[2:], dt.nll)
        assert [m["loss"] for m in again] == [m["loss"] for m in uninterrupted]
        assert [m["lr"] for m in again] == [m["lr"] for m in uninterrupted]
        assert dt.max_diff(dt.full_weights(policy), final) == 0.0
    finally:
        policy.shutdown()

    # warmup over 2 steps, then cosine from step 2 to step 5
    cosine_step3 = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3))
    assert [m["lr"] for m in first + uninterrupted] == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3 * cosine_step3])
    assert all(m["grad_norm"] > 0.5 for m in first + uninterrupted)

    # through the registry, as a run builds it; one rank holds plain (unsharded) tensors
    single_ckpt = str(tmp_path / "step_2_single")
    fresh = plugin_host().policy_backends["dtensor"](_config(dt, tiny_model_path, 1), virtual_cluster)
    try:
        fresh.load_checkpoint(ckpt)
        fresh.save_checkpoint(single_ckpt)
        resumed = _steps(fresh, batches[2:], dt.nll)
        for got, want in zip(resumed, uninterrupted, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
            assert got["lr"] == want["lr"]
        assert dt.max_diff(dt.full_weights(fresh), final) < 1e-6
    finally:
        fresh.shutdown()

    # and back: the single rank's checkpoint resumes sharded over two ranks
    sharded = DTensorPolicy(_config(dt, tiny_model_path, 2), virtual_cluster, name="policy-resume-2")
    try:
        sharded.load_checkpoint(single_ckpt)
        resumed = _steps(sharded, batches[2:], dt.nll)
        assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in uninterrupted], abs=1e-6)
        assert dt.max_diff(dt.full_weights(sharded), final) < 1e-6
    finally:
        sharded.shutdown()
