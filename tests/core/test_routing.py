"""Routing replay on transformers' own mixture-of-experts models: the routers keep their choices,
use given experts as a hand-written router would, pass gradients to the router through them,
and count agreement; the metrics turn summed counts into fractions."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.backend.routing import NO_ROUTE, Routers, agreement_metrics, padded_routes
from posttrain.testing.zoo import zoo_config
from tests.routing_reference import given_router

ARCHITECTURES = ["qwen3_moe", "mixtral"]


def tiny_moe(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(zoo_config(name, tokenizer="character"), dtype=torch.float32)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_recorded_routes_replayed_give_the_same_bits(name):
    model = tiny_moe(name).eval()
    routers = Routers(model, record=True)
    ids = torch.randint(0, 60, (3, 9))
    with torch.no_grad():
        free = model(ids).logits
    own = routers.take()
    assert own.shape == (27, 2, 2) and own.dtype == torch.int16
    assert routers.take().shape[0] == 0  # taken once
    routers.set(own)
    with torch.no_grad():
        replayed = model(ids).logits
    assert torch.equal(replayed, free)
    assert agreement_metrics(routers.agreement_counts())["moe/router_agreement"] == 1.0


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_given_experts_are_used_and_train_the_router_like_a_router_that_chose_them(name):
    ids = torch.randint(0, 60, (2, 7))
    replaying, reference = tiny_moe(name), tiny_moe(name)
    routers = Routers(replaying, record=True)
    with torch.no_grad():
        replaying(ids)
    own = routers.take()
    given = (own.long() + 1) % 4  # every token's experts shifted: none chosen alike in layer 0
    given[3] = NO_ROUTE  # one token keeps the router's own choice
    expected = given.clone()
    expected[3] = own[3]

    routers.set(given.to(torch.int16))
    replaying(ids).logits.square().mean().backward()
    counts = routers.agreement_counts()
    hooks = [given_router(module, expected[:, layer]) for layer, module in enumerate(Routers(reference).modules)]
    reference(ids).logits.square().mean().backward()
    for hook in hooks:
        hook.remove()

    assert counts["moe/router_routed_tokens/layer_00"] == 13  # the token without a route is not counted
    assert counts["moe/router_matched_tokens/layer_00"] == 0
    for (path, mine), theirs in zip(replaying.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7, msg=path)
    router_weight = routers.modules[0].weight.grad
    assert router_weight is not None and router_weight.abs().sum() > 0


def test_a_dense_model_and_a_wrong_layer_count_are_refused():
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(zoo_config("qwen3", tokenizer="character"))
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM has no mixture-of-experts router \(a module named \*TopKRouter\)"):
        Routers(dense)
    routers = Routers(tiny_moe("qwen3_moe"))
    with pytest.raises(ValueError, match="routing replay: routes of 3 layers for a model with 2 routers"):
        routers.set(torch.zeros((5, 3, 2), dtype=torch.int16))


def test_a_route_count_that_does_not_match_the_forward_names_both():
    model = tiny_moe("mixtral")
    routers = Routers(model)
    routers.set(torch.zeros((5, 2, 2), dtype=torch.int16))
    with pytest.raises(ValueError, match=r"routing replay: 5 tokens of routes with k=2 for a router forward of 8 tokens with k=2"):
        model(torch.zeros((1, 8), dtype=torch.long))


def test_agreement_metrics_are_fractions_of_the_summed_counts():
    counts = {"loss": 1.5, "moe/router_routed_tokens/layer_00": 10.0, "moe/router_matched_tokens/layer_00": 9.0,
              "moe/router_routed_tokens/layer_01": 30.0, "moe/router_matched_tokens/layer_01": 15.0}
    assert agreement_metrics(counts) == {"loss": 1.5, "moe/router_agreement": 24 / 40,
                                         "moe/router_agreement/layer_00": 0.9, "moe/router_agreement/layer_01": 0.5}
    assert agreement_metrics({"loss": 1.0}) == {"loss": 1.0}


def test_padded_routes_fill_with_no_route():
    rows = [torch.ones((2, 3, 2), dtype=torch.int16), torch.empty((0, 0, 0), dtype=torch.int16), None]
    out = padded_routes(rows, 4)
    assert out.shape == (3, 4, 3, 2)
    assert out[0, :2].eq(1).all() and out[0, 2:].eq(NO_ROUTE).all() and out[1:].eq(NO_ROUTE).all()
