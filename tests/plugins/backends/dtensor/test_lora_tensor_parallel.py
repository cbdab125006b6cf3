"""LoRA under tensor parallel on the plans whose layers gather their output or split their
input themselves (Phi-3's fused ``qkv_proj`` and ``gate_up_proj``, OLMo 2's q/k/v): both
adapter matrices stay whole, and two SGD steps at learning rate 1 move every adapter by the
float64 gradient peft computes from the adapter exported before the step (the first step
moves B only), as on one rank (``test_lora.py``)."""

from __future__ import annotations

import pytest

from posttrain.config.schema import LoraConfig
from posttrain_dtensor.policy import DTensorPolicy
from tests.plugins.backends.dtensor.test_lora import adapter_tensors, peft_grads

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules="all-linear")


@pytest.mark.parametrize("arch", ["phi3", "olmo2"])
def test_adapter_gradients_equal_peft_under_tensor_parallel(arch, virtual_cluster, dt, tmp_path):
    from posttrain.testing.zoo import build_zoo_model

    path = str(build_zoo_model(tmp_path / arch, arch, num_key_value_heads=2))
    config = dt.policy_config(path, num_workers=2, tensor_parallel_size=2, lora=LORA)
    policy = DTensorPolicy(config, virtual_cluster, name=f"lora-tp2-{arch}")
    batch, exported = dt.make_batch(), []
    try:
        for step in range(3):
            exported.append(tmp_path / f"adapter_{step}")
            policy.export_hf(str(exported[-1]))
            if step < 2:
                policy.train(batch, dt.nll)
    finally:
        policy.shutdown()
    for step in range(2):
        expected = peft_grads(path, str(exported[step]), batch)
        moved = dt.sgd_grads(adapter_tensors(exported[step]), adapter_tensors(exported[step + 1]), lr=1.0)
        assert sorted(moved) == sorted(expected)
        assert dt.max_diff(moved, expected) < 1e-6, f"step {step + 1}"
