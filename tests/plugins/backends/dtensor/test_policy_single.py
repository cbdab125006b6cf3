"""One-rank dtensor policy on Ray against an independent float64 reference (plain
transformers + autograd, one sample at a time).

One worker group serves the module; tests that train first restore the initial weights
with ``load_checkpoint``. Optimizer: SGD with lr=1, so a step's weight change is the
gradient. The batching options are read by the driver at every pass, so tests switch
packing, dynamic batching and microbatch sizes on the live policy.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import DynamicBatchingConfig, SequencePackingConfig
from posttrain.plugins import plugin_host
from posttrain_dtensor.config import DTensorConfig
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def setup(tiny_model_path, virtual_cluster, dt, tmp_path_factory):
    # activation checkpointing on: every gradient check below also covers recomputation
    config = dt.policy_config(tiny_model_path, dtensor=DTensorConfig(activation_checkpointing=True))
    policy = DTensorPolicy(config, virtual_cluster, name="policy-single")
    initial_ckpt = str(tmp_path_factory.mktemp("initial") / "step_0")
    policy.save_checkpoint(initial_ckpt)
    batch = dt.make_batch()
    ref_loss, ref_grads = dt.reference_step(tiny_model_path, batch)
    yield dict(
        policy=policy,
        initial_ckpt=initial_ckpt,
        initial_weights=dt.full_weights(policy),
        batch=batch,
        ref_loss=ref_loss,
        ref_grads=ref_grads,
    )
    policy.shutdown()


def _step_grads(policy, setup, dt) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    metrics = policy.train(setup["batch"], dt.nll)
    return metrics, dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)


def test_plugin_registers_backend_and_section():
    from posttrain_dtensor.plugin import make_policy

    host = plugin_host()
    assert host.policy_backends["dtensor"] is make_policy
    assert host.config_sections["policy.dtensor"] is DTensorConfig


@pytest.mark.parametrize("mode", ["padded", "packed", "dynamic"])
def test_logprobs_equal_a_direct_transformers_forward(policy, setup, dt, tiny_model_path, mode):
    if mode == "packed":
        policy.config.policy.sequence_packing = SequencePackingConfig(enabled=True, max_tokens_per_row=32)
    if mode == "dynamic":
        policy.config.policy.dynamic_batching = DynamicBatchingConfig(enabled=True, max_tokens_per_microbatch=40)
    got = policy.get_logprobs(setup["batch"])["logprobs"]
    want = dt.reference_logprobs(dt.reference_model(tiny_model_path), setup["batch"])
    assert got.dtype == torch.float32 and got.shape == setup["batch"]["input_ids"].shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_topk_logits_equal_transformers_topk(policy, setup, dt, tiny_model_path):
    batch = setup["batch"]
    out = policy.get_topk_logits(batch, 4)
    model = dt.reference_model(tiny_model_path)
    width = batch["input_ids"].shape[1]
    assert out["topk_logits"].shape == (len(batch), width - 1, 4)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        logits = model(batch["input_ids"][i : i + 1, :n]).logits[0]
        values, indices = logits.topk(4, dim=-1)
        m = min(n, width - 1)
        torch.testing.assert_close(out["topk_logits"][i, :m].double(), values[:m], rtol=0, atol=1e-5)
        assert torch.equal(out["topk_indices"][i, :m], indices[:m])


def test_full_batch_step_has_reference_loss_and_gradients(policy, setup, dt):
    metrics, grads = _step_grads(policy, setup, dt)
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-6)
    assert dt.max_diff(grads, setup["ref_grads"]) < 5e-7  # so within 1e-6 of any other layout that passes
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in setup["ref_grads"].values()))
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)
    assert metrics["token_share"] == pytest.approx(1.0) and metrics["sequence_share"] == pytest.approx(1.0)
    valid = setup["batch"]["token_mask"] * setup["batch"]["sample_mask"][:, None]
    assert metrics["num_tokens"] == float(valid.sum())
    assert metrics["lr"] == 1.0 and metrics["step_time_s"] > 0


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_microbatch_accumulation_equals_the_full_batch(policy, setup, dt, micro_batch_size):
    _, full = _step_grads(policy, setup, dt)
    policy.load_checkpoint(setup["initial_ckpt"])
    policy.config.policy.train_micro_batch_size = micro_batch_size
    metrics, accumulated = _step_grads(policy, setup, dt)
    assert dt.max_diff(accumulated, full) < 1e-6
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-6)
    assert metrics["token_share"] == pytest.approx(1.0) and metrics["sequence_share"] == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["packed", "dynamic"])
def test_packed_and_dynamic_batches_give_padded_gradients(policy, setup, dt, mode):
    _, padded = _step_grads(policy, setup, dt)
    policy.load_checkpoint(setup["initial_ckpt"])
    if mode == "packed":
        policy.config.policy.sequence_packing = SequencePackingConfig(enabled=True, max_tokens_per_row=32, round_to=4)
    else:
        policy.config.policy.dynamic_batching = DynamicBatchingConfig(enabled=True, max_tokens_per_microbatch=40)
    metrics, grads = _step_grads(policy, setup, dt)
    assert dt.max_diff(grads, padded) < 1e-5
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-5)


def test_reference_logprobs_stay_those_of_the_initial_weights(policy, setup, dt):
    batch = setup["batch"]
    before = policy.get_logprobs(batch)["logprobs"]
    for _ in range(2):
        policy.train(batch, dt.nll)
    reference = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    after = policy.get_logprobs(batch)["logprobs"]
    assert torch.equal(reference, before)
    assert (after - before).abs().max() > 0.1  # the current weights did move
    # and the swap put the trained weights back
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], after, rtol=0, atol=0)


def test_a_policy_built_without_reference_keeps_no_initial_weights(policy, setup, dt, tiny_model_path, virtual_cluster):
    """reference=False (a run that never asks for reference logprobs): the worker holds no
    copy of the initial weights, the policy computes the same logprobs, and a reference pass
    is refused naming the worker group and the fix."""
    import ray

    from posttrain.errors import PluginError

    def reference_tensors(p):
        if p.group.driver_rank is not None:  # the worker in this process (policy.in_driver)
            return len(p.group.driver_rank.worker._reference)
        return ray.get(p.group.actors[0].__ray_call__.remote(lambda worker: len(worker._reference)))

    config = dt.policy_config(tiny_model_path)
    lean = plugin_host().policy_backends["dtensor"](config, virtual_cluster, name="policy-lean", reference=False)
    try:
        assert reference_tensors(policy) == len(setup["initial_weights"]) > 0
        assert reference_tensors(lean) == 0
        batch = setup["batch"]
        torch.testing.assert_close(lean.get_logprobs(batch)["logprobs"], policy.get_logprobs(batch)["logprobs"],
                                   rtol=0, atol=0)
        with pytest.raises(PluginError, match=(
            r"^reference logprobs were asked of the worker group 'policy-lean', which was built without reference "
            r"weights \(its factory's reference=False, from RunContext\.build_policy\(reference=False\)\); build it "
            r"with reference=True to compute them$")):
            lean.get_reference_policy_logprobs(batch)
    finally:
        lean.shutdown()


def test_eval_mode_reports_the_loss_without_stepping(policy, setup, dt):
    metrics = policy.train(setup["batch"], dt.nll, eval_mode=True)
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-6)
    assert "grad_norm" not in metrics
    assert dt.max_diff(dt.full_weights(policy), setup["initial_weights"]) == 0.0


def test_export_weights_yields_bounded_buckets_of_full_hf_tensors(policy, setup, tiny_model_path):
    from safetensors.torch import load_file

    bucket_bytes = 20_000
    buckets = list(policy.export_weights(bucket_bytes))
    on_disk = load_file(f"{tiny_model_path}/model.safetensors")
    seen = {}
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for t in bucket.values())
        assert size <= bucket_bytes or len(bucket) == 1
        seen.update(bucket)
    assert len(buckets) > 2
    assert seen.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(seen[name], tensor), name


def test_exported_hf_folder_reloads_with_identical_logits(policy, setup, dt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batch = setup["batch"]
    policy.train(batch, dt.nll)  # export trained weights, not the initial file
    policy.export_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").pad_token_id == 0
    exported = dict(model.named_parameters())
    trained = dt.full_weights(policy)
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    lp = policy.get_logprobs(batch)["logprobs"]
    topk = policy.get_topk_logits(batch, 3)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        logits = model(batch["input_ids"][i : i + 1, :n]).logits[0].double()
        want = logits[:-1].log_softmax(-1).gather(-1, batch["input_ids"][i, 1:n, None])[:, 0]
        torch.testing.assert_close(lp[i, 1:n].double(), want * batch["token_mask"][i, 1:n], rtol=0, atol=1e-5)
        m = min(n, batch["input_ids"].shape[1] - 1)
        torch.testing.assert_close(topk["topk_logits"][i, :m].double(), logits[:m].topk(3).values, rtol=0, atol=1e-5)


def test_loading_a_missing_checkpoint_names_the_folder(policy, tmp_path):
    from posttrain.errors import WorkerError

    with pytest.raises(WorkerError, match=r"load_checkpoint\(\) raised .*policy checkpoint '.*nothing' is incomplete"):
        policy.load_checkpoint(str(tmp_path / "nothing"))


def test_info_and_offload_on_cpu(policy, setup):
    """Offloaded, a forward pass is refused by the driver, and a worker asked directly for a
    forward or a gather refuses too, on the CPU as on a GPU (where they would run on tensors
    of two devices, or NCCL gathers on CPU shards); prepared again, it runs."""
    from posttrain.backend.policy_worker import PolicyWorker
    from posttrain.errors import PluginError, WorkerError

    info = policy.info()
    assert info["parameters"] == sum(t.numel() for t in setup["initial_weights"].values())
    assert (info["data_parallel_size"], info["tensor_parallel_size"], info["device"]) == (1, 1, "cpu")
    policy.offload()
    with pytest.raises(PluginError, match=r"logprobs pass of the worker group 'policy-single' while its weights are "
                                          r"offloaded .*call prepare_for_training\(\) first"):
        policy.get_logprobs(setup["batch"])
    name = next(iter(setup["initial_weights"]))
    with pytest.raises(WorkerError, match=r"gather_weights\(\) raised RuntimeError: dtensor policy rank 0: a gather of "
                                          r"the weights while the weights are offloaded"):
        policy.group.run_all(PolicyWorker.gather_weights, [name])
    # a sync or an export of the offloaded policy brings the weights alone back: gathers run, a step refuses
    policy.group.run_all(PolicyWorker.onload_weights)
    assert policy.group.run_all(PolicyWorker.gather_weights, [name])[0][name].shape == setup["initial_weights"][name].shape
    with pytest.raises(WorkerError, match=r"a training step while the optimizer state is in CPU memory "
                                          r"\(onload_weights\(\) brought the weights alone back\); call "
                                          r"prepare_for_training\(\) first"):
        policy.group.run_all(PolicyWorker.train, None, None)  # refused before it reads its work
    policy.prepare_for_training()
    assert policy.get_logprobs(setup["batch"])["logprobs"].abs().sum() > 0
