"""The dtensor policy at ``generation.temperature = 0.7``: its logprobs, reference logprobs
and training loss are those of ``logits / 0.7`` (what a generation backend reports for its
samples), checked against an independent float64 transformers forward; top-k logits stay raw.

One two-rank group (data parallel 2) serves the module, so the scaled head runs on sharded
FSDP weights and the gradients are all-reduced across ranks.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.config.schema import GenerationConfig
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup(tiny_model_path, virtual_cluster, dt):
    config = dt.policy_config(tiny_model_path, num_workers=2)
    config = attrs.evolve(config, generation=GenerationConfig(temperature=TEMPERATURE))
    policy = DTensorPolicy(config, virtual_cluster, name="policy-temperature")
    yield dict(policy=policy, batch=dt.make_batch(), initial_weights=dt.full_weights(policy))
    policy.shutdown()


def test_logprobs_are_those_of_logits_over_the_temperature(setup, dt, tiny_model_path):
    batch = setup["batch"]
    model = dt.reference_model(tiny_model_path)
    want = dt.reference_logprobs(model, batch, TEMPERATURE)
    got = setup["policy"].get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    # the scaling is not a no-op on this batch
    assert (want - dt.reference_logprobs(model, batch)).abs().max() > 0.1
    reference = setup["policy"].get_reference_policy_logprobs(batch)["reference_logprobs"]
    torch.testing.assert_close(reference.double(), want, rtol=0, atol=1e-5)


def test_topk_logits_stay_unscaled(setup, dt, tiny_model_path):
    batch = setup["batch"]
    out = setup["policy"].get_topk_logits(batch, 3)
    model = dt.reference_model(tiny_model_path)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        values = model(batch["input_ids"][i : i + 1, :n]).logits[0, : n - 1].topk(3, dim=-1).values
        torch.testing.assert_close(out["topk_logits"][i, : n - 1].double(), values, rtol=0, atol=1e-5)


def test_training_loss_and_gradients_use_the_scaled_logits(setup, dt, tiny_model_path):
    """Run last in the module: the SGD step (lr=1) changes the weights by the gradient."""
    policy, batch = setup["policy"], setup["batch"]
    ref_loss, ref_grads = dt.reference_step(tiny_model_path, batch, TEMPERATURE)
    metrics = policy.train(batch, dt.nll)
    grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)
    assert dt.max_diff(grads, ref_grads) < 1e-6
    # the tolerances above are far below what the temperature changes
    untempered_loss, untempered_grads = dt.reference_step(tiny_model_path, batch)
    assert abs(untempered_loss - ref_loss) > 1e-3
    assert dt.max_diff(untempered_grads, ref_grads) > 1e-3
