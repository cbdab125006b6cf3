"""The routers' losses of a mixture of experts in the dtensor policy (``policy.moe.aux_loss_coef``,
``z_loss_coef``): the load-balancing loss it reports is transformers' own
(``load_balancing_loss_func`` over the real tokens, the term TRL adds), in padded and packed
rows; a training step's gradient is that of the token NLL plus the weighted router losses,
computed independently in float64; the expert load per layer is reported; a router they do not
serve (DeepSeek-V3's) is refused."""

from __future__ import annotations

import attrs
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from posttrain.backend.router_losses import expert_assignments, expert_loads, load_balancing_loss, z_loss
from posttrain.config.schema import MoEConfig, SequencePackingConfig
from posttrain.testing.policy import reference_model
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

AUX, Z = 0.5, 0.05  # large enough that a wrong weight shows in every router's gradient


def test_the_router_losses_are_transformers_and_st_moes_formulas():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(12, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    mask = torch.tensor([[1] * 5 + [0], [1] * 6], dtype=torch.long)  # [2, 6] rows flattened: 12 tokens
    valid = mask.reshape(-1).bool()
    assert float(load_balancing_loss(expert_assignments(logits, valid, 2), valid)) == pytest.approx(
        float(load_balancing_loss_func(tuple(logits), 4, 2, mask)), rel=1e-6)  # transformers sums in float32
    assert float(z_loss(logits, valid)) == pytest.approx(
        sum(float((torch.logsumexp(layer[valid], -1) ** 2).mean()) for layer in logits) / 3, rel=1e-12)
    even = torch.zeros(4, 4, dtype=torch.float64)  # every expert tied: topk takes the first two for every token
    assert expert_loads(expert_assignments([even], torch.ones(4, dtype=torch.bool), 2)) == [2.0]  # 2 of 4 experts take it all: 2x even


def reference(model_path: str, batch, aux: float, z: float) -> tuple[float, float, float, dict[str, torch.Tensor]]:
    """Float64: the token NLL (over the step's loss tokens), the load-balancing loss and z-loss
    of the batch's real tokens (one padded forward, its attention mask), and the gradients of
    the NLL plus ``aux`` and ``z`` times them."""
    model = reference_model(model_path)
    mask = (torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]).long()
    out = model(batch["input_ids"], attention_mask=mask, output_router_logits=True)
    config = model.config
    lb = load_balancing_loss_func(out.router_logits, config.num_experts, config.num_experts_per_tok, mask)
    valid = mask.reshape(-1).bool()
    zl = torch.stack([(torch.logsumexp(layer[valid], -1) ** 2).mean() for layer in out.router_logits]).mean()
    ids = batch["input_ids"]
    logprobs = out.logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    weights = (batch["token_mask"] * batch["sample_mask"][:, None]).double()[:, 1:]
    nll = -(logprobs * weights).sum() / weights.sum()
    (nll + aux * lb + z * zl).backward()
    return float(nll.detach()), float(lb.detach()), float(zl.detach()), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def setup(zoo_model, virtual_cluster, dt, tmp_path_factory):
    model = zoo_model("qwen3_moe")
    config = dt.policy_config(model, moe=MoEConfig(aux_loss_coef=AUX, z_loss_coef=Z))
    policy = DTensorPolicy(config, virtual_cluster, name="policy-router-losses")
    batch = dt.make_batch()
    ckpt = str(tmp_path_factory.mktemp("router-losses") / "step_0")
    policy.save_checkpoint(ckpt)
    yield dict(policy=policy, batch=batch, model=model, initial_ckpt=ckpt, reference=reference(model, batch, AUX, Z))
    policy.shutdown()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_step_trains_on_the_nll_and_the_weighted_router_losses(setup, policy, dt, packed):
    nll, lb, zl, grads = setup["reference"]
    p = policy.config.policy
    # one forward of all 79 tokens (the router losses are a microbatch's, weighted by its share of the loss tokens)
    policy.config.policy = attrs.evolve(p, sequence_packing=SequencePackingConfig(enabled=packed, max_tokens_per_row=96))
    before = dt.full_weights(policy)
    metrics = policy.train(setup["batch"], dt.nll)
    found = dt.sgd_grads(before, dt.full_weights(policy), lr=1.0)  # SGD at lr 1: the weight change is the gradient
    assert metrics["moe/aux_loss"] == pytest.approx(lb, abs=1e-5)
    assert metrics["moe/z_loss"] == pytest.approx(zl, abs=1e-5)
    loads = [metrics[f"moe/expert_load/layer_{i:02d}"] for i in range(2)]
    assert all(1.0 <= load <= 2.0 for load in loads), loads  # 4 experts, 2 per token: at most 2x an even share
    assert metrics["loss"] == pytest.approx(nll, abs=1e-5)  # the reported loss is the NLL alone
    for name, grad in grads.items():
        assert (found[name] - grad).abs().max() < 1e-5, name
    router_grads = [grads[name] for name in grads if name.endswith("gate.weight")]
    assert router_grads and all(float(g.abs().max()) > 1e-3 for g in router_grads)


def test_each_microbatch_weighs_its_router_losses_by_its_share_of_the_loss_tokens(setup, policy, dt):
    batch = setup["batch"]
    policy.config.policy = attrs.evolve(policy.config.policy, train_micro_batch_size=4)  # samples 0-3, then 4-7
    metrics = policy.train(batch, dt.nll)
    halves = [batch.select(torch.arange(0, 4)), batch.select(torch.arange(4, 8))]
    weights = [float((half["token_mask"] * half["sample_mask"][:, None]).sum()) for half in halves]
    losses = [reference(setup["model"], half, AUX, Z)[1] for half in halves]
    expected = sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)
    assert metrics["moe/aux_loss"] == pytest.approx(expected, abs=1e-5)
    assert abs(expected - setup["reference"][1]) > 1e-3  # not the whole batch's: the loss is not linear in tokens


def test_router_losses_on_a_router_they_do_not_serve_are_refused(zoo_model, virtual_cluster, dt, tmp_path):
    """DeepSeek-V3's router picks experts by groups (``DeepseekV3TopkRouter``): refused when
    the policy loads it, not trained silently without the losses."""
    model = dt.deepseek_v3(tmp_path / "deepseek_v3", zoo_model("qwen3_moe"))
    config = dt.policy_config(model, moe=MoEConfig(aux_loss_coef=AUX))
    with pytest.raises(Exception, match=r"policy.moe.aux_loss_coef: DeepseekV3ForCausalLM has no router whose losses "
                                        r"the dtensor backend computes .* set policy.moe.aux_loss_coef: 0 for this model"):
        DTensorPolicy(config, virtual_cluster, name="policy-router-losses-deepseek").shutdown()
