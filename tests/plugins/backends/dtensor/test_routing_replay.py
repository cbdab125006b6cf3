"""Routing replay in the dtensor policy (``policy.moe.routing_replay: rollout``): given experts
that differ from the routers' own, the policy's logprobs and gradients are those of an
independent float64 forward whose routers return those experts (transformers, one sample at a
time), in padded and packed rows, with activation checkpointing recomputing the forward in
the backward pass; the agreement metric counts the tokens the routers would have chosen alike.
With ``routing_replay: previous`` the logprob pass returns the experts its routers chose."""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.backend.routing import NO_ROUTE
from posttrain.config.schema import MoEConfig, SequencePackingConfig
from posttrain_dtensor.config import DTensorConfig
from posttrain_dtensor.policy import DTensorPolicy
from tests.routing_reference import replayed_reference, shifted_routes

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def setup(zoo_model, virtual_cluster, dt):
    model = zoo_model("qwen3_moe")
    config = dt.policy_config(model, dtensor=DTensorConfig(activation_checkpointing=True),
                              moe=MoEConfig(routing_replay="rollout"))
    policy = DTensorPolicy(config, virtual_cluster, name="policy-replay")
    batch = dt.make_batch()
    batch["routed_experts"] = shifted_routes(model, batch)
    logprobs, grads = replayed_reference(model, batch)
    yield dict(policy=policy, batch=batch, logprobs=logprobs, grads=grads, initial=dt.full_weights(policy))
    policy.shutdown()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replayed_logprobs_are_those_of_routers_that_chose_the_given_experts(setup, packed):
    policy, batch = setup["policy"], setup["batch"]
    p = policy.config.policy
    policy.config.policy = attrs.evolve(p, sequence_packing=SequencePackingConfig(enabled=packed, max_tokens_per_row=40))
    try:
        replayed = policy.get_logprobs(batch)["logprobs"] * batch["token_mask"]
        free = policy.get_logprobs(batch.fields([name for name in batch if name != "routed_experts"]))["logprobs"]
    finally:
        policy.config.policy = p
    assert (replayed.double() - setup["logprobs"]).abs().max() < 1e-5
    assert (free * batch["token_mask"] - replayed).abs().max() > 0.1  # the given experts are not the routers' own


def test_agreement_counts_real_tokens_whatever_the_padding_holds(setup, dt):
    """The routers' own experts given back, the field padded with 0 past each sample (as a data
    plane pads samples of different widths): every real token agrees; padding is not counted."""
    policy, batch = setup["policy"], setup["batch"]
    own = batch.fields([name for name in batch if name != "routed_experts"])
    shifted = batch["routed_experts"].long()
    own["routed_experts"] = torch.where(shifted >= 0, (shifted - 1) % 4, 0).to(torch.int16)
    metrics = policy.train(own, dt.nll, eval_mode=True)
    assert metrics["moe/router_agreement"] > 0.95  # 79 real tokens of 192 padded positions


def test_replayed_gradients_and_agreement(setup, dt):
    policy, batch = setup["policy"], setup["batch"]
    metrics = policy.train(batch, dt.nll)
    grads = dt.sgd_grads(setup["initial"], dt.full_weights(policy), lr=1.0)
    for name, expected in setup["grads"].items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6, msg=name)
    # the first layer's routers see the token embeddings: none of them would choose the shifted experts
    assert metrics["moe/router_agreement/layer_00"] == 0.0
    assert 0.0 <= metrics["moe/router_agreement"] < 0.5


@pytest.fixture(scope="module")
def previous(zoo_model, virtual_cluster, dt):
    model = zoo_model("qwen3_moe")
    config = dt.policy_config(model, moe=MoEConfig(routing_replay="previous"))
    policy = DTensorPolicy(config, virtual_cluster, name="policy-replay-previous")
    yield model, policy
    policy.shutdown()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_previous_logprob_pass_returns_the_experts_its_routers_chose(previous, dt, packed):
    """``routing_replay: previous``: each token's experts, as transformers' routers choose them
    (each sample alone, float32), NO_ROUTE past each sample; the reference pass returns none."""
    model, policy = previous
    batch = dt.make_batch()
    p = policy.config.policy
    policy.config.policy = attrs.evolve(p, sequence_packing=SequencePackingConfig(enabled=packed, max_tokens_per_row=40))
    try:
        result = policy.get_logprobs(batch)
        reference = policy.get_reference_policy_logprobs(batch)
    finally:
        policy.config.policy = p
    own = (shifted_routes(model, batch).long() - 1) % 4  # the float32 model's own experts (shifted back)
    real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    routes = result["routed_experts"]
    assert routes.dtype == torch.int16 and routes.shape == (*batch["input_ids"].shape, 2, 2)
    assert torch.equal(routes[real].long().sort(-1).values, own[real].sort(-1).values)
    assert bool((routes[~real] == NO_ROUTE).all())
    assert "routed_experts" not in reference


def test_the_training_pass_replays_the_previous_experts_and_counts_agreement(previous, dt):
    """Given back to a training pass at the same weights, every real token's own experts are the
    given ones (agreement 1); after an update they are still given, and counted against the new routers."""
    _, policy = previous
    batch = dt.make_batch()
    batch["routed_experts"] = policy.get_logprobs(batch)["routed_experts"]
    first = policy.train(batch, dt.nll)
    assert first["moe/router_agreement"] == 1.0
    second = policy.train(batch, dt.nll, eval_mode=True)  # SGD at lr 1 moved the routers
    assert 0.0 < second["moe/router_agreement"] < 1.0
