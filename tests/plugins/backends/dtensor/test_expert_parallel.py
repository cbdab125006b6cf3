"""Expert parallelism (``policy.moe.expert_parallel_size``) against one rank: two ranks in one
expert-parallel group (DeepSeek-V3, with multi-head latent attention, a shared expert and
group-limited routing), the same group with each of its ranks a tensor-parallel pair (Qwen3-MoE
on four ranks: attention split over each pair, the experts over the group), and four ranks in
two groups, where FSDP also sums the
experts' gradients over the groups (Mixtral). Each rank holds half of every layer's experts and
the tokens reach them by all-to-all; the logprobs are one rank's within 1e-6 (relative), a
step's gradients within 1e-6; so are a LoRA step's (the split experts frozen). SGD with lr=1: a
step's weight change is the gradient."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import LoraConfig, MoEConfig, SequencePackingConfig
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

# name: (architecture, num_workers, tensor-parallel size); expert_parallel_size 2 throughout, 4 experts per layer
LAYOUTS = {"ep2_tp2": ("qwen3_moe", 4, 2), "ep2_deepseek_v3": ("deepseek_v3", 2, 1), "ep2_dp2": ("mixtral", 4, 1)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def setup(request, zoo_model, virtual_cluster, dt, tmp_path_factory):
    from posttrain.testing.zoo import build_zoo_model

    architecture, workers, tp = LAYOUTS[request.param]
    if architecture == "deepseek_v3":
        model = dt.deepseek_v3(tmp_path_factory.mktemp("deepseek_v3"), zoo_model("qwen3_moe"))
    elif tp > 1:  # key/value heads the tensor-parallel size divides
        model = str(build_zoo_model(tmp_path_factory.mktemp(architecture), architecture, num_key_value_heads=tp))
    else:
        model = zoo_model(architecture)
    batch = dt.make_batch()
    one_rank = DTensorPolicy(dt.policy_config(model), virtual_cluster, name=f"policy-{request.param}-one-rank")
    initial = dt.full_weights(one_rank)
    one_rank_logprobs = one_rank.get_logprobs(batch)["logprobs"]
    one_rank.train(batch, dt.nll)
    one_rank_grads = dt.sgd_grads(initial, dt.full_weights(one_rank), lr=1.0)
    one_rank.shutdown()
    config = dt.policy_config(model, num_workers=workers, tensor_parallel_size=tp, moe=MoEConfig(expert_parallel_size=2))
    policy = DTensorPolicy(config, virtual_cluster, name=f"policy-{request.param}")
    initial_ckpt = str(tmp_path_factory.mktemp(request.param) / "step_0")
    policy.save_checkpoint(initial_ckpt)
    yield dict(policy=policy, layout=request.param, initial_ckpt=initial_ckpt, initial_weights=initial, batch=batch,
               one_rank_logprobs=one_rank_logprobs, one_rank_grads=one_rank_grads)
    policy.shutdown()


def test_each_rank_holds_half_of_the_experts(policy, setup):
    info = policy.info()
    _, workers, tp = LAYOUTS[setup["layout"]]
    assert (info["world_size"], info["data_parallel_size"], info["expert_parallel_size"]) == (workers, workers // tp, 2)
    assert info["tensor_parallel_size"] == tp
    assert info["experts_per_rank"] == 2


def test_logprobs_are_one_ranks(policy, setup):
    got = policy.get_logprobs(setup["batch"])["logprobs"]
    # Relative: the logprobs are about -5 to -9, where float32's spacing is 4.8e-7 to 9.5e-7, and each rank's
    # rows are padded to another width than one rank's (dp=2 without expert parallelism differs alike: 2.9e-6).
    torch.testing.assert_close(got, setup["one_rank_logprobs"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["one_microbatch", "microbatches", "packed"])
def test_a_step_gives_one_ranks_gradients(policy, setup, dt, mode):
    if mode == "microbatches":
        policy.config.policy.train_micro_batch_size = 1
    if mode == "packed":
        policy.config.policy.sequence_packing = SequencePackingConfig(enabled=True, max_tokens_per_row=32)
    metrics = policy.train(setup["batch"], dt.nll)
    grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    assert dt.max_diff(grads, setup["one_rank_grads"]) < 1e-6
    assert metrics["token_share"] == pytest.approx(1.0) and metrics["sequence_share"] == pytest.approx(1.0)
    experts = [g for name, g in grads.items() if ".experts." in name]
    assert len(experts) == 4 and all(float(g.abs().max()) > 1e-4 for g in experts)  # 2 layers x 2 packed tensors


def test_lora_with_the_experts_split_steps_as_one_rank(zoo_model, virtual_cluster, dt):
    model, batch, lora = zoo_model("qwen3_moe"), dt.make_batch(), LoraConfig(enabled=True, rank=4, alpha=8.0)
    weights = []
    for workers, ep in [(1, 1), (2, 2)]:
        config = dt.policy_config(model, num_workers=workers, lora=lora, moe=MoEConfig(expert_parallel_size=ep))
        policy = DTensorPolicy(config, virtual_cluster, name=f"policy-lora-ep{ep}")
        try:
            policy.train(batch, dt.nll)
            weights.append(dt.full_weights(policy))  # the merged weights: base + the stepped adapters
        finally:
            policy.shutdown()
    one_rank, split = weights
    assert dt.max_diff(split, one_rank) < 1e-6
