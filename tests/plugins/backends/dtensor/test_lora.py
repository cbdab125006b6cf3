"""LoRA on the dtensor policy (``policy.lora``), on one rank, FSDP2 (dp=2) and tensor parallel
(tp=2), against references built with peft directly.

- step 0 (B = 0): the adapted policy's logprobs equal its base model's bit for bit (the
  reference pass, adapters off), and on one rank those of the full fine-tuning policy;
- gradients: two SGD steps at learning rate 1; each step's change of the exported adapter is
  the float64 gradient of a peft model loaded from the adapter exported before it (the first
  step moves B only: A's gradient is zero while B is);
- the reference policy stays the base model after training;
- the export is a PEFT folder that ``PeftModel.from_pretrained`` loads with the policy's top-k
  logits, and its merged model equals peft's ``merge_and_unload``;
- checkpoints hold the adapters and their optimizer state only, and resume exactly (AdamW).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.backend.adapter_folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_FOLDER
from posttrain.config.schema import LoraConfig, OptimizerConfig
from posttrain_dtensor.config import DTensorConfig
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules="all-linear", export_merged=True)
# name: (num_workers, tensor_parallel_size, backend options); dp2 also recomputes layers in backward
LAYOUTS = {
    "one_rank": (1, 1, DTensorConfig()),
    "fsdp_dp2": (2, 1, DTensorConfig(reshard_after_forward=False, activation_checkpointing=True)),
    "tp2": (2, 2, DTensorConfig()),
}


def peft_reference(model_path: str, adapter: str, dtype: torch.dtype = torch.float64):
    """The base model in ``dtype`` with the exported ``adapter`` loaded by peft."""
    from peft import PeftModel

    from posttrain.testing.policy import reference_model

    return PeftModel.from_pretrained(reference_model(model_path, dtype), adapter, is_trainable=True).to(dtype)


def peft_grads(model_path: str, adapter: str, batch) -> dict[str, torch.Tensor]:
    """float64 gradients of the global-batch token NLL for every adapter matrix, by PEFT name."""
    from posttrain.testing.policy import reference_logprobs

    model = peft_reference(model_path, adapter)
    mask = batch["token_mask"].double() * batch["sample_mask"].double()[:, None]
    (-(reference_logprobs(model, batch) * mask).sum() / mask.sum()).backward()
    return {name.replace(".default", ""): p.grad for name, p in model.named_parameters() if p.requires_grad}


def adapter_tensors(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / ADAPTER_WEIGHTS))


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tiny_model_path, virtual_cluster, dt, tmp_path_factory):
    workers, tp, options = LAYOUTS[request.param]
    config = dt.policy_config(tiny_model_path, dtensor=options, num_workers=workers, tensor_parallel_size=tp, lora=LORA)
    policy = DTensorPolicy(config, virtual_cluster, name=f"lora-{request.param}")
    scratch = tmp_path_factory.mktemp(f"lora-{request.param}")
    initial = str(scratch / "initial")
    policy.save_checkpoint(initial)
    yield dict(name=request.param, policy=policy, scratch=scratch, initial=initial)
    policy.shutdown()


@pytest.fixture
def policy(layout):
    layout["policy"].load_checkpoint(layout["initial"])
    return layout["policy"]


def test_step_zero_is_the_base_model_exactly(policy, layout, dt, tiny_model_path, virtual_cluster):
    batch = dt.make_batch()
    adapted = policy.get_logprobs(batch)["logprobs"]
    assert torch.equal(adapted, policy.get_reference_policy_logprobs(batch)["reference_logprobs"])
    if layout["name"] == "one_rank":
        full = DTensorPolicy(dt.policy_config(tiny_model_path), virtual_cluster, name="full-fine-tuning")
        try:
            assert torch.equal(adapted, full.get_logprobs(batch)["logprobs"])
        finally:
            full.shutdown()


def test_adapter_gradients_equal_peft_in_float64(policy, layout, dt, tiny_model_path):
    batch = dt.make_batch()
    exported = []
    for step in range(3):
        folder = layout["scratch"] / f"adapter_{step}"
        policy.export_hf(str(folder))
        exported.append(folder)
        if step < 2:
            metrics = policy.train(batch, dt.nll)
    for step in range(2):
        expected = peft_grads(tiny_model_path, str(exported[step]), batch)
        moved = dt.sgd_grads(adapter_tensors(exported[step]), adapter_tensors(exported[step + 1]), lr=1.0)
        assert dt.max_diff(moved, expected) < 1e-6, f"step {step + 1}"
        assert any(float(g.abs().max()) > 1e-3 for n, g in expected.items() if "lora_A" in n) == (step == 1)
    norm = torch.sqrt(sum(g.pow(2).sum() for g in expected.values()))
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)


def test_reference_stays_the_base_model_after_training(policy, dt):
    batch = dt.make_batch()
    base = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    policy.train(batch, dt.nll)
    assert not torch.allclose(policy.get_logprobs(batch)["logprobs"], base), "a step changed nothing"
    assert torch.equal(policy.get_reference_policy_logprobs(batch)["reference_logprobs"], base)
    policy.train(batch, dt.nll)  # training still reaches the adapters after a reference pass
    assert not torch.allclose(policy.get_logprobs(batch)["logprobs"], base)


def test_export_loads_in_peft_with_the_policys_logits_and_merges_as_peft_does(policy, layout, dt, tiny_model_path):
    batch = dt.make_batch()
    policy.train(batch, dt.nll)
    folder = layout["scratch"] / "export"
    policy.export_hf(str(folder))
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    model = peft_reference(tiny_model_path, str(folder), torch.float32).eval()
    k = 3
    out = policy.get_topk_logits(batch, k)
    with torch.no_grad():
        for i, length in enumerate(batch["input_lengths"].tolist()):
            values, indices = model(batch["input_ids"][i : i + 1, :length]).logits[0, : length - 1].topk(k, dim=-1)
            torch.testing.assert_close(out["topk_logits"][i, : length - 1], values, rtol=1e-5, atol=1e-5)
            assert torch.equal(out["topk_indices"][i, : length - 1], indices)
    merged = model.merge_and_unload().state_dict()
    exported = {k: v for shard in sorted((folder / MERGED_FOLDER).glob("*.safetensors")) for k, v in load_file(shard).items()}
    assert exported.keys() == merged.keys()
    assert all(torch.equal(exported[name], merged[name]) for name in merged)


def test_weight_sync_sends_the_merged_weights(policy, dt, tmp_path):
    batch = dt.make_batch()
    policy.train(batch, dt.nll)
    policy.export_hf(str(tmp_path))
    synced = dt.full_weights(policy)
    merged = {k: v for shard in (tmp_path / MERGED_FOLDER).glob("*.safetensors") for k, v in load_file(shard).items()}
    assert synced.keys() == merged.keys() and all(torch.equal(synced[n], merged[n]) for n in merged)


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_hold_the_adapters_and_resume_exactly(tiny_model_path, virtual_cluster, dt, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    config = dt.policy_config(tiny_model_path, lora=LORA, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
    policy = DTensorPolicy(config, virtual_cluster, name="lora-adamw")
    try:
        first, second = dt.make_batch(seed=1), dt.make_batch(seed=2)
        policy.train(first, dt.nll)
        policy.save_checkpoint(str(tmp_path / "step_1"))
        expected_metrics = policy.train(second, dt.nll)
        expected = policy.get_logprobs(second)["logprobs"]
        policy.train(first, dt.nll)  # move on, then go back
        policy.load_checkpoint(str(tmp_path / "step_1"))
        metrics = policy.train(second, dt.nll)
        assert torch.equal(policy.get_logprobs(second)["logprobs"], expected)
        assert (metrics["loss"], metrics["grad_norm"]) == (expected_metrics["loss"], expected_metrics["grad_norm"])
    finally:
        policy.shutdown()
    keys = FileSystemReader(str(tmp_path / "step_1")).read_metadata().state_dict_metadata
    tensors = [key for key in keys if key.startswith(("model.", "optimizer.state."))]
    assert tensors and all(".lora_A." in key or ".lora_B." in key for key in tensors), tensors
    assert any(key.endswith("exp_avg_sq") for key in tensors)  # AdamW's state, of the adapters only
