"""Two megatron ranks in each parallel layout, against dtensor on the same weights and the
float64 reference: tensor parallel, tensor + sequence parallel on Qwen2 (q/k/v biases, tied
embeddings), tensor parallel on Qwen3 (per-head q/k norms, whose gradients megatron-core
sums over the ranks), pipeline parallel (megatron-core's 1F1B schedule over gloo), and data parallel
with the distributed optimizer (AdamW, against a float64 transformers + torch AdamW run).

SGD layouts use lr=1, so a step's weight change is the gradient; every layout trains with
two microbatches or more per rank, so accumulation is covered too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.config.schema import OptimizerConfig  # noqa: E402
from posttrain_megatron.config import MegatronConfig  # noqa: E402
from posttrain_megatron.policy import MegatronPolicy  # noqa: E402
from posttrain_sft.loss import NLLLoss  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.ray]

ADAMW = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
# name: (model, config overrides, (dp, tp, pp))
LAYOUTS = {
    "tp2": ("llama", dict(num_workers=2, tensor_parallel_size=2), (1, 2, 1)),
    "qwen2_tp2_sp": ("qwen2", dict(num_workers=2, tensor_parallel_size=2,
                                   megatron=MegatronConfig(sequence_parallel=True)), (1, 2, 1)),
    "qwen3_tp2": ("qwen3", dict(num_workers=2, tensor_parallel_size=2), (1, 2, 1)),
    "pp2": ("llama", dict(num_workers=2, megatron=MegatronConfig(pipeline_parallel_size=2)), (1, 1, 2)),
    "dp2_distopt": ("llama", dict(num_workers=2, optimizer=ADAMW,
                                  megatron=MegatronConfig(distributed_optimizer=True)), (2, 1, 1)),
}


#: Pipeline parallel and the distributed optimizer start their own worker groups too; with
#: them the module takes more than two minutes on two cores.
SLOW_LAYOUTS = ("pp2", "dp2_distopt", "qwen3_tp2")


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name for name in LAYOUTS
])
def setup(request, llama_path, qwen2_path, virtual_cluster, mg, tmp_path_factory):
    model, overrides, _ = LAYOUTS[request.param]
    if model == "qwen3":
        from posttrain.testing.zoo import build_zoo_model

        path = str(build_zoo_model(tmp_path_factory.mktemp("qwen3_kv2"), "qwen3", num_key_value_heads=2))
    else:
        path = llama_path if model == "llama" else qwen2_path
    policy = MegatronPolicy(mg.policy_config(path, train_micro_batch_size=2, **overrides), virtual_cluster,
                            name=f"megatron-{request.param}")
    yield dict(policy=policy, layout=request.param, model_path=path, batch=mg.make_batch(),
               initial_weights=mg.full_weights(policy))
    policy.shutdown()


@pytest.fixture
def policy(setup):
    """The layout's policy with its initial weights: the tests below that train run last,
    in file order (no checkpoint round trip between tests)."""
    if setup.get("trained"):
        pytest.fail(f"layout {setup['layout']}: a test that needs the initial weights ran after one that trained")
    return setup["policy"]


@pytest.fixture
def trainable(setup):
    """The layout's policy, for a test that changes its weights."""
    setup["trained"] = True
    return setup["policy"]


def test_layout_is_what_was_asked(policy, setup):
    info = policy.info()
    dp, tp, pp = LAYOUTS[setup["layout"]][2]
    assert (info["data_parallel_size"], info["tensor_parallel_size"], info["pipeline_parallel_size"]) == (dp, tp, pp)
    assert info["world_size"] == 2
    assert info["sequence_parallel"] == (setup["layout"] == "qwen2_tp2_sp")


def test_logprobs_equal_dtensor_and_the_reference(policy, setup, mg, request):
    batch = setup["batch"]
    got = policy.get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(got.double(), mg.reference_logprobs(setup["model_path"], batch), rtol=0, atol=1e-5)
    if LAYOUTS[setup["layout"]][0] == "llama":  # the dtensor policy holds the Llama
        dtensor = request.getfixturevalue("dtensor_policy")
        torch.testing.assert_close(got, dtensor.get_logprobs(batch)["logprobs"], rtol=0, atol=1e-5)
    odd = batch.slice(0, 7)  # not a multiple of the data-parallel size
    torch.testing.assert_close(policy.get_logprobs(odd)["logprobs"], got[:7], rtol=0, atol=1e-6)


def test_topk_logits_equal_transformers_topk(policy, setup, mg):
    batch = setup["batch"]
    out = policy.get_topk_logits(batch, 5)
    width = batch["input_ids"].shape[1]
    for i, (values, indices) in enumerate(mg.reference_topk(setup["model_path"], batch, 5)):
        m = min(int(batch["input_lengths"][i]), width - 1)
        torch.testing.assert_close(out["topk_logits"][i, :m].double(), values[:m], rtol=0, atol=1e-5)
        assert torch.equal(out["topk_indices"][i, :m], indices[:m])


def test_exported_weights_are_the_hf_file_bit_for_bit(policy, setup):
    from safetensors.torch import load_file

    on_disk = load_file(f"{setup['model_path']}/model.safetensors")
    assert setup["initial_weights"].keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(setup["initial_weights"][name], tensor), name


def test_weight_sync_sends_the_exported_weights_in_bounded_stages(policy, setup, mg):
    """Tensor slices are merged and pipeline stages gathered one layer group at a time: the
    engine receives the initial weights the HF file holds (test above), staged in bounds."""
    from posttrain.testing.policy import staging_bound, synced_weights

    received, version, stats = synced_weights(policy, bucket_bytes=32 * 1024, version=2)
    assert version == 2 and mg.max_diff(received, setup["initial_weights"]) == 0.0
    assert stats.num_buckets > 1 and 0 < stats.peak_staging_bytes <= staging_bound(setup["initial_weights"], 32 * 1024)


def test_training_matches_the_reference(policy, setup, mg):
    setup["trained"] = True
    if setup["layout"] == "dp2_distopt":
        _check_adamw_steps(policy, setup, mg)
        return
    mg.check_sgd_step(policy, setup["model_path"], setup["batch"], setup["initial_weights"], grad_atol=5e-7)


def _check_adamw_steps(policy, setup, mg):
    """Three AdamW steps (weights sharded over the optimizer's data-parallel ranks) against
    transformers + torch.optim.AdamW in float64: the same losses and weights."""
    model = mg.reference_model(setup["model_path"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW.lr, betas=tuple(ADAMW.betas), eps=ADAMW.eps,
                                  weight_decay=ADAMW.weight_decay)
    batch = setup["batch"]
    mask = batch["token_mask"].double() * batch["sample_mask"].double()[:, None]
    for step in range(3):
        optimizer.zero_grad()
        loss = -(mg.reference_logprobs(model, batch) * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        metrics = policy.train(batch, NLLLoss())
        assert metrics["loss"] == pytest.approx(float(loss), abs=1e-4), step
    want = {k: v.detach() for k, v in model.named_parameters()}
    assert mg.max_diff(mg.full_weights(policy), want) < 1e-4
    assert mg.max_diff(want, setup["initial_weights"]) > 1e-2  # the weights moved


def test_checkpoint_resume_continues_exactly(trainable, setup, mg, tmp_path):
    policy = trainable
    batch = setup["batch"]
    policy.train(batch, NLLLoss())
    policy.save_checkpoint(str(tmp_path / "step_1"))
    second = policy.train(batch, NLLLoss())
    weights = mg.full_weights(policy)
    policy.load_checkpoint(str(tmp_path / "step_1"))
    again = policy.train(batch, NLLLoss())
    assert again["loss"] == second["loss"] and again["grad_norm"] == second["grad_norm"]
    assert mg.max_diff(mg.full_weights(policy), weights) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["tp2"], indirect=True)
def test_checkpoint_loads_under_another_layout(trainable, setup, mg, virtual_cluster, tmp_path):
    """A tensor-parallel checkpoint, loaded by one rank: the same weights and next step."""
    policy, batch = trainable, setup["batch"]
    policy.train(batch, NLLLoss())
    policy.save_checkpoint(str(tmp_path / "step_1"))
    weights, following = mg.full_weights(policy), policy.train(batch, NLLLoss())
    single = MegatronPolicy(mg.policy_config(setup["model_path"]), virtual_cluster, name="megatron-reloaded")
    try:
        single.load_checkpoint(str(tmp_path / "step_1"))
        assert mg.max_diff(mg.full_weights(single), weights) == 0.0
        assert single.train(batch, NLLLoss())["loss"] == pytest.approx(following["loss"], abs=1e-6)
    finally:
        single.shutdown()
