"""Two ranks, FSDP2 (dp=2) and tensor parallel (tp=2), against the float64 reference.

The single-rank tests hold the same checks at the same tolerance (gradients within 5e-7 of
the reference), so every layout is within 1e-6 of one rank. SGD with lr=1: a step's weight
change is the gradient. Both ranks hold shards; the loss shares summing to exactly 1 across
ranks shows the global token and sequence counts were reduced over data-parallel ranks.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import DynamicBatchingConfig, SequencePackingConfig
from posttrain_dtensor.config import DTensorConfig
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

# name: (num_workers, tensor_parallel_size, backend options). dp2 keeps layers gathered
# between forward and backward, so the checks also cover that FSDP2 mode.
LAYOUTS = {
    "fsdp_dp2": (2, 1, DTensorConfig(reshard_after_forward=False)),
    "tp2": (2, 2, DTensorConfig()),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def setup(request, tiny_model_path, virtual_cluster, dt, tmp_path_factory):
    workers, tp, options = LAYOUTS[request.param]
    config = dt.policy_config(tiny_model_path, dtensor=options, num_workers=workers, tensor_parallel_size=tp)
    policy = DTensorPolicy(config, virtual_cluster, name=f"policy-{request.param}")
    initial_ckpt = str(tmp_path_factory.mktemp(request.param) / "step_0")
    policy.save_checkpoint(initial_ckpt)
    batch = dt.make_batch()
    ref_loss, ref_grads = dt.reference_step(tiny_model_path, batch)
    yield dict(
        policy=policy,
        layout=request.param,
        initial_ckpt=initial_ckpt,
        initial_weights=dt.full_weights(policy),
        batch=batch,
        ref_loss=ref_loss,
        ref_grads=ref_grads,
        ref_model=dt.reference_model(tiny_model_path),
    )
    policy.shutdown()


def _check_step(policy, setup, dt, grad_tol: float) -> None:
    metrics = policy.train(setup["batch"], dt.nll)
    grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    assert dt.max_diff(grads, setup["ref_grads"]) < grad_tol
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-6)
    assert metrics["token_share"] == pytest.approx(1.0) and metrics["sequence_share"] == pytest.approx(1.0)
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in setup["ref_grads"].values()))
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)


def test_layout_is_what_was_asked(policy, setup):
    info = policy.info()
    workers, tp, _ = LAYOUTS[setup["layout"]]
    assert (info["world_size"], info["tensor_parallel_size"], info["data_parallel_size"]) == (workers, tp, workers // tp)


def test_full_batch_step_matches_the_reference(policy, setup, dt):
    _check_step(policy, setup, dt, grad_tol=5e-7)


def test_microbatches_on_every_rank_accumulate_to_the_full_batch(policy, setup, dt):
    policy.config.policy.train_micro_batch_size = 1
    _check_step(policy, setup, dt, grad_tol=5e-7)


@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_packed_and_dynamic_batches_match_the_reference(policy, setup, dt, mode):
    if mode == "packed":
        policy.config.policy.sequence_packing = SequencePackingConfig(enabled=True, max_tokens_per_row=32)
    else:
        policy.config.policy.dynamic_batching = DynamicBatchingConfig(enabled=True, max_tokens_per_microbatch=40)
    got = policy.get_logprobs(setup["batch"])["logprobs"]
    torch.testing.assert_close(got.double(), dt.reference_logprobs(setup["ref_model"], setup["batch"]), rtol=0, atol=1e-5)
    _check_step(policy, setup, dt, grad_tol=1e-5)


def test_logprobs_of_a_batch_not_divisible_by_dp(policy, setup, dt):
    batch = setup["batch"].slice(0, 7)
    got = policy.get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(got.double(), dt.reference_logprobs(setup["ref_model"], batch), rtol=0, atol=1e-5)


def test_sharded_reference_swap_restores_both_weight_sets(policy, setup, dt):
    batch = setup["batch"]
    initial = policy.get_logprobs(batch)["logprobs"]
    policy.train(batch, dt.nll)
    trained = policy.get_logprobs(batch)["logprobs"]
    assert torch.equal(policy.get_reference_policy_logprobs(batch)["reference_logprobs"], initial)
    assert torch.equal(policy.get_logprobs(batch)["logprobs"], trained)
    assert (trained - initial).abs().max() > 0.1


@pytest.mark.slow
def test_two_dimensional_dp2_tp2_matches_the_reference(tiny_model_path, virtual_cluster, dt):
    """dp=2 x tp=2 on four ranks (slow on two cores)."""
    config = dt.policy_config(tiny_model_path, num_workers=4, tensor_parallel_size=2, train_micro_batch_size=2)
    batch = dt.make_batch()
    ref_loss, ref_grads = dt.reference_step(tiny_model_path, batch)
    policy = DTensorPolicy(config, virtual_cluster, name="policy-2d")
    try:
        before = dt.full_weights(policy)
        metrics = policy.train(batch, dt.nll)
        grads = dt.sgd_grads(before, dt.full_weights(policy), lr=1.0)
        assert dt.max_diff(grads, ref_grads) < 5e-7
        assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)
        assert metrics["token_share"] == pytest.approx(1.0)
    finally:
        policy.shutdown()


def test_weight_sync_sends_the_exported_weights_in_bounded_stages(policy, setup, dt):
    """Sharded ranks gather one layer group at a time: the engine receives the same bytes
    as the export (which the tests above tie to the single-rank reference)."""
    from posttrain.testing.policy import staging_bound, synced_weights

    policy.train(setup["batch"], dt.nll)
    expected = dt.full_weights(policy)
    received, version, stats = synced_weights(policy, bucket_bytes=32 * 1024, version=5)
    assert version == 5 and dt.max_diff(received, expected) == 0.0
    assert stats.num_buckets > 1 and 0 < stats.peak_staging_bytes <= staging_bound(expected, 32 * 1024)
