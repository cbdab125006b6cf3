"""Mixtures of experts on megatron-core: Qwen3-MoE (a dense first layer, the top-k of the
softmax over all experts) on one rank, and Mixtral (the k chosen experts' weights
renormalised) with its experts split over two expert-parallel ranks, and with every expert
split over two tensor-parallel ranks (with sequence parallelism), against the float64
reference (plain transformers + autograd) on the same checkpoint, which stores every expert on
its own.

The Qwen3-MoE policy runs with ``routing_replay: previous`` (its logprob pass returns the
experts its routers chose), the tensor-parallel Mixtral with ``routing_replay: rollout``; both
replay the routes of a batch through megatron-core's replay hook: their logprobs and
gradients are then those of a float64 forward whose routers return the given experts
(:mod:`tests.routing_reference`).

SGD with lr=1, so a step's weight change is the gradient; tests that train start from the
initial weights (a checkpoint loaded), so the module checks checkpoints of split experts too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.backend.routing import NO_ROUTE  # noqa: E402
from posttrain.config.schema import MoEConfig  # noqa: E402
from posttrain_megatron.config import MegatronConfig  # noqa: E402
from posttrain_megatron.policy import MegatronPolicy  # noqa: E402
from posttrain_sft.loss import NLLLoss  # noqa: E402
from tests.routing_reference import replayed_reference, shifted_routes  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.ray]

# name: (zoo architecture, its overrides, policy overrides, expert-parallel size)
LAYOUTS = {
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[0]), dict(num_workers=1, moe=MoEConfig(routing_replay="previous")), 1),
    "mixtral_ep2": ("mixtral", {}, dict(num_workers=2, moe=MoEConfig(expert_parallel_size=2)), 2),
    "mixtral_tp2_sp": ("mixtral", dict(num_key_value_heads=2),
                       dict(num_workers=2, tensor_parallel_size=2, megatron=MegatronConfig(sequence_parallel=True),
                            moe=MoEConfig(routing_replay="rollout")), 1),
}
#: The layouts that replay routes.
REPLAYING = ["qwen3_moe", "mixtral_tp2_sp"]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def setup(request, virtual_cluster, mg, tmp_path_factory):
    from posttrain.testing.zoo import build_zoo_model

    arch, model_overrides, overrides, _ = LAYOUTS[request.param]
    path = str(build_zoo_model(tmp_path_factory.mktemp(request.param), arch, tokenizer="character", **model_overrides))
    policy = MegatronPolicy(mg.policy_config(path, train_micro_batch_size=2, **overrides), virtual_cluster,
                            name=f"megatron-{request.param}")
    initial = str(tmp_path_factory.mktemp(f"{request.param}_step_0"))
    policy.save_checkpoint(initial)
    yield dict(policy=policy, layout=request.param, model_path=path, batch=mg.make_batch(),
               initial_weights=mg.full_weights(policy), initial=initial)
    policy.shutdown()


@pytest.fixture
def restored(setup):
    """The layout's policy at its initial weights and step."""
    setup["policy"].load_checkpoint(setup["initial"])
    return setup["policy"]


@pytest.fixture
def replay(setup, mg):
    """A batch whose routes move every token's experts one on from the routers' own, and the
    float64 replayed reference (layouts of :data:`REPLAYING`)."""
    assert setup["layout"] in REPLAYING, "replay tests run on the layouts that replay (parametrize setup with them)"
    if "replayed" not in setup:
        batch = setup["batch"].fields(list(setup["batch"]))
        batch["routed_experts"] = shifted_routes(setup["model_path"], batch)
        setup["replayed"] = (batch, *replayed_reference(setup["model_path"], batch, mg.TEMPERATURE))
    return setup["replayed"]


def test_layout_and_exported_weights_are_transformers_own(setup, mg):
    """The experts are split as asked, and the weights the policy exports are transformers'
    in-memory tensors (experts packed per layer) bit for bit, read from per-expert files."""
    from transformers import AutoModelForCausalLM

    info = setup["policy"].info()
    assert info["expert_parallel_size"] == LAYOUTS[setup["layout"]][3]
    model = AutoModelForCausalLM.from_pretrained(setup["model_path"], dtype=torch.float32)
    assert mg.max_diff(setup["initial_weights"], dict(model.state_dict())) == 0.0
    assert any(".experts." in name for name in setup["initial_weights"])


def test_logprobs_equal_the_reference(setup, mg):
    batch = setup["batch"]
    got = setup["policy"].get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(got.double(), mg.reference_logprobs(setup["model_path"], batch), rtol=0, atol=1e-5)


def test_training_matches_the_reference(setup, restored, mg):
    # gradients up to 0.96 (the embedding's), whose float32 sums differ from float64 by up to 2.6e-6 with
    # the experts on one rank or split (measured); a wrong expert or weight is off by more than 1e-2
    mg.check_sgd_step(restored, setup["model_path"], setup["batch"], setup["initial_weights"], grad_atol=4e-6)


@pytest.mark.parametrize("setup", REPLAYING, indirect=True)
def test_replayed_logprobs_are_those_of_routers_that_chose_the_given_experts(setup, restored, replay):
    batch, logprobs, _ = replay
    replayed = restored.get_logprobs(batch)["logprobs"] * batch["token_mask"]
    free = restored.get_logprobs(setup["batch"])["logprobs"] * batch["token_mask"]
    assert (replayed.double() - logprobs).abs().max() < 1e-5
    assert (free - replayed).abs().max() > 0.1  # the given experts are not the routers' own


@pytest.mark.parametrize("setup", ["qwen3_moe"], indirect=True)
def test_the_logprob_pass_returns_the_experts_the_routers_chose(setup, restored, replay):
    """``routing_replay: previous``: each token's experts as transformers' routers choose them
    (each sample alone, float32), NO_ROUTE past each sample; the reference pass returns none.
    Given back, every real token agrees, whatever the padding holds (0 here, as a data plane
    pads), and a training step replays them."""
    batch = setup["batch"]
    result = restored.get_logprobs(batch)
    own = (replay[0]["routed_experts"].long() - 1) % 4  # the float32 model's own experts (shifted back)
    real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    routes = result["routed_experts"]
    assert routes.dtype == torch.int16 and routes.shape == (*batch["input_ids"].shape, 1, 2)
    assert torch.equal(routes[real].long().sort(-1).values, own[real].sort(-1).values)
    assert bool((routes[~real] == NO_ROUTE).all())
    assert "routed_experts" not in restored.get_reference_policy_logprobs(batch)
    given = batch.fields(list(batch))
    given["routed_experts"] = torch.where(routes >= 0, routes, 0).to(torch.int16)
    assert restored.train(given, NLLLoss())["moe/router_agreement"] == 1.0
    assert 0.0 < restored.train(given, NLLLoss(), eval_mode=True)["moe/router_agreement"] < 1.0  # routers moved


@pytest.mark.parametrize("setup", REPLAYING, indirect=True)
def test_replayed_gradients_and_agreement(setup, restored, replay, mg):
    batch, _, ref_grads = replay
    grads, metrics = mg.sgd_step(restored, batch, setup["initial_weights"])
    assert mg.max_diff(grads, ref_grads) < 4e-6
    # the first mixture-of-experts layer's routers see the same inputs as without replay: they would choose
    # none of the shifted experts (all of the routers, counted over the sequence split of both ranks)
    assert metrics["moe/router_agreement/layer_00"] == 0.0
    assert 0.0 <= metrics["moe/router_agreement"] < 0.5
