"""One megatron rank on Ray against dtensor on the same weights and an independent float64
reference (plain transformers + autograd, one sample at a time).

One worker group per backend serves the module; tests that train first restore the initial
weights with ``load_checkpoint``. Optimizer: SGD with lr=1, so a step's weight change is
the gradient. SFT and GRPO steps use the installed loss plugins through the registry.
"""

from __future__ import annotations

import attrs
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.config.schema import DynamicBatchingConfig  # noqa: E402
from posttrain.errors import WorkerError  # noqa: E402
from posttrain.plugins import plugin_host  # noqa: E402
from posttrain_megatron.policy import MegatronPolicy  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.ray]


@pytest.fixture(scope="module")
def setup(llama_path, virtual_cluster, dtensor_policy, mg, tmp_path_factory):
    policy = MegatronPolicy(mg.policy_config(llama_path), virtual_cluster, name="megatron-single")
    folder = tmp_path_factory.mktemp("megatron_single")
    policy.save_checkpoint(str(folder / "megatron_step_0"))
    dtensor_policy.save_checkpoint(str(folder / "dtensor_step_0"))
    batch = mg.make_batch()
    ref_loss, ref_grads = mg.reference_nll_step(llama_path, batch)
    yield dict(
        policy=policy,
        dtensor=dtensor_policy,
        folder=folder,
        initial_weights=mg.full_weights(policy),
        batch=batch,
        ref_loss=ref_loss,
        ref_grads=ref_grads,
    )
    policy.shutdown()


def _restore(policy, checkpoint: str):
    """Initial weights, optimizer state and step; one microbatch per rank, no dynamic batching."""
    policy.load_checkpoint(checkpoint)
    p = policy.config.policy
    policy.config.policy = attrs.evolve(p, train_micro_batch_size=p.train_global_batch_size // policy.config.data_parallel_size,
                                        dynamic_batching=DynamicBatchingConfig())
    return policy


@pytest.fixture
def policy(setup):
    return _restore(setup["policy"], str(setup["folder"] / "megatron_step_0"))


@pytest.fixture
def dtensor(setup):
    return _restore(setup["dtensor"], str(setup["folder"] / "dtensor_step_0"))


def _sgd_grads(before, after):
    return {k: before[k].double() - after[k].double() for k in before}  # lr = 1


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("mode", ["padded", "dynamic"])
def test_logprobs_equal_dtensor_and_the_float64_reference(policy, dtensor, setup, mg, llama_path, mode):
    if mode == "dynamic":
        policy.config.policy.dynamic_batching = DynamicBatchingConfig(enabled=True, max_tokens_per_microbatch=40)
    batch = setup["batch"]
    got = policy.get_logprobs(batch)["logprobs"]
    assert got.dtype == torch.float32 and got.shape == batch["input_ids"].shape
    torch.testing.assert_close(got, dtensor.get_logprobs(batch)["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.double(), mg.reference_logprobs(llama_path, batch), rtol=0, atol=1e-5)


def test_topk_logits_equal_transformers_topk(policy, setup, mg, llama_path):
    batch = setup["batch"]
    out = policy.get_topk_logits(batch, 4)
    width = batch["input_ids"].shape[1]
    assert out["topk_logits"].shape == out["topk_indices"].shape == (len(batch), width - 1, 4)
    for i, (values, indices) in enumerate(mg.reference_topk(llama_path, batch, 4)):
        m = min(int(batch["input_lengths"][i]), width - 1)
        torch.testing.assert_close(out["topk_logits"][i, :m].double(), values[:m], rtol=0, atol=1e-5)
        assert torch.equal(out["topk_indices"][i, :m], indices[:m])
        assert not out["topk_logits"][i, m:].any()


def test_exported_weights_are_the_hf_file_bit_for_bit(policy, llama_path):
    """HF -> megatron (loaded by the rank) -> HF (gathered for refit) is exact, in bounded buckets."""
    from safetensors.torch import load_file

    on_disk = load_file(f"{llama_path}/model.safetensors")
    buckets = list(policy.export_weights(20_000))
    assert len(buckets) > 2
    assert all(sum(t.numel() * t.element_size() for t in b.values()) <= 20_000 or len(b) == 1 for b in buckets)
    seen = {k: v for b in buckets for k, v in b.items()}
    assert seen.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(seen[name], tensor), name


@pytest.mark.parametrize("micro_batch_size", [8, 3])
def test_sgd_step_has_the_reference_loss_and_gradients(policy, setup, micro_batch_size):
    """Microbatches accumulate to the full batch (global normalisation)."""
    from posttrain_sft.loss import NLLLoss

    policy.config.policy.train_micro_batch_size = micro_batch_size
    metrics = policy.train(setup["batch"], NLLLoss())
    grads = _sgd_grads(setup["initial_weights"], _weights(policy))
    assert _max_diff(grads, setup["ref_grads"]) < 5e-7
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-6)
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in setup["ref_grads"].values()))
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)
    valid = setup["batch"]["token_mask"] * setup["batch"]["sample_mask"][:, None]
    assert metrics["num_tokens"] == float(valid.sum()) and metrics["lr"] == 1.0


def _weights(policy):
    return {k: v for bucket in policy.export_weights(1 << 16) for k, v in bucket.items()}


def test_sft_steps_match_dtensor(policy, dtensor, setup):
    """Three steps with the ``nll`` loss from the registry: the same losses (1e-4) and weights."""
    nll = plugin_host().losses["nll"](None)
    batch = setup["batch"]
    losses = []
    for step in range(3):
        got, want = policy.train(batch, nll), dtensor.train(batch, nll)
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-4), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), step
        losses.append(got["loss"])
    assert abs(losses[2] - losses[0]) > 0.05  # the steps took effect
    assert _max_diff(_weights(policy), _weights(dtensor)) < 1e-4


def test_grpo_steps_match_dtensor(policy, dtensor, setup):
    """Three steps with ``clipped_pg`` (clipping, KL to the reference): per step, previous
    and reference logprobs from each backend, then the same losses and metrics (1e-4)."""
    from posttrain_grpo.config import ClippedPGConfig

    loss = plugin_host().losses["clipped_pg"](ClippedPGConfig(ratio_clip_low=0.1, ratio_clip_high=0.1, kl_penalty=0.05))
    batch = setup["batch"]
    advantages = torch.linspace(-1.0, 1.0, len(batch)) * 0.2
    for step in range(3):
        metrics = []
        for backend in (policy, dtensor):
            step_batch = batch.fields(batch.keys())
            step_batch["advantages"] = advantages
            step_batch["prev_logprobs"] = backend.get_logprobs(batch)["logprobs"]
            step_batch["reference_logprobs"] = backend.get_reference_policy_logprobs(batch)["reference_logprobs"]
            metrics.append(backend.train(step_batch, loss))
        got, want = metrics
        assert got.keys() == want.keys()
        for name in want.keys() - {"step_time_s", "grad_norm"}:
            assert got[name] == pytest.approx(want[name], abs=1e-4), (step, name)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), step
    assert want["kl"] > 1e-4  # the policy moved away from the reference


def test_reference_logprobs_stay_those_of_the_initial_weights(policy, setup):
    from posttrain_sft.loss import NLLLoss

    batch = setup["batch"]
    before = policy.get_logprobs(batch)["logprobs"]
    policy.train(batch, NLLLoss())
    reference = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    after = policy.get_logprobs(batch)["logprobs"]
    assert torch.equal(reference, before)
    assert (after - before).abs().max() > 0.1  # the current weights did move
    assert torch.equal(policy.get_logprobs(batch)["logprobs"], after)  # and came back after the swap


def test_eval_mode_reports_the_loss_without_stepping(policy, setup):
    from posttrain_sft.loss import NLLLoss

    metrics = policy.train(setup["batch"], NLLLoss(), eval_mode=True)
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-6)
    assert "grad_norm" not in metrics
    assert _max_diff(_weights(policy), setup["initial_weights"]) == 0.0


def test_checkpoint_resume_continues_exactly(policy, setup, tmp_path):
    from posttrain_sft.loss import NLLLoss

    batch = setup["batch"]
    policy.train(batch, NLLLoss())
    policy.save_checkpoint(str(tmp_path / "step_1"))
    second = policy.train(batch, NLLLoss())
    weights = _weights(policy)
    policy.load_checkpoint(str(tmp_path / "step_1"))
    again = policy.train(batch, NLLLoss())
    assert again["loss"] == second["loss"] and again["grad_norm"] == second["grad_norm"]
    assert _max_diff(_weights(policy), weights) == 0.0


def test_exported_hf_folder_reloads_with_the_policys_logprobs(policy, setup, mg, tmp_path):
    from transformers import AutoTokenizer

    from posttrain_sft.loss import NLLLoss

    batch = setup["batch"]
    policy.train(batch, NLLLoss())  # export trained weights, not the initial file
    policy.export_hf(str(tmp_path / "hf"))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").pad_token_id == 0
    want = mg.reference_logprobs(str(tmp_path / "hf"), batch)
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"].double(), want, rtol=0, atol=1e-5)


def test_loading_a_missing_checkpoint_names_the_folder(policy, tmp_path):
    with pytest.raises(WorkerError, match=r"policy checkpoint '.*nothing' is incomplete or not a megatron policy checkpoint"):
        policy.load_checkpoint(str(tmp_path / "nothing"))


def test_info_and_offload_on_cpu(policy, setup):
    info = policy.info()
    assert info["backend"] == "megatron"
    assert info["parameters"] == sum(t.numel() for t in setup["initial_weights"].values())
    assert (info["data_parallel_size"], info["tensor_parallel_size"], info["pipeline_parallel_size"]) == (1, 1, 1)
    assert info["device"] == "cpu"
    policy.offload()
    policy.prepare_for_training()
    assert policy.get_logprobs(setup["batch"])["logprobs"].abs().sum() > 0


def test_bfloat16_training_through_megatrons_mixed_precision_optimizer(llama_path, virtual_cluster, mg, tmp_path):
    """bfloat16 weights with float32 master weights in megatron-core's optimizer: the initial
    export is the file rounded to bfloat16, logprobs are within bfloat16 error of the
    float64 reference, AdamW steps lower the loss, and a checkpoint round trip is exact."""
    from safetensors.torch import load_file

    from posttrain.config.schema import OptimizerConfig
    from posttrain_sft.loss import NLLLoss

    config = mg.policy_config(llama_path, dtype="bfloat16", optimizer=OptimizerConfig(name="adamw", lr=1e-2))
    policy = MegatronPolicy(config, virtual_cluster, name="megatron-bf16")
    try:
        batch = mg.make_batch()
        exported = _weights(policy)
        for name, tensor in load_file(f"{llama_path}/model.safetensors").items():
            assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor.bfloat16()), name
        got = policy.get_logprobs(batch)["logprobs"]
        assert float((got.double() - mg.reference_logprobs(llama_path, batch)).abs().max()) < 2e-2
        losses = [policy.train(batch, NLLLoss())["loss"] for _ in range(3)]
        assert losses[2] < losses[0] - 0.5, losses
        policy.save_checkpoint(str(tmp_path / "step_3"))
        following = policy.train(batch, NLLLoss())
        policy.load_checkpoint(str(tmp_path / "step_3"))
        assert policy.train(batch, NLLLoss())["loss"] == following["loss"]
    finally:
        policy.shutdown()
