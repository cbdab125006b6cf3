"""LoRA SFT parity with TRL + PEFT: from the same adapters, one SGD step on the same batch.

Our side: the dtensor policy with ``policy.lora`` (one rank) exports its initial adapters as a
PEFT folder, then takes one SGD step with the SFT loss. TRL's side: ``SFTTrainer`` on the tiny
model with that folder loaded by ``PeftModel.from_pretrained`` (``is_trainable``) takes one SGD
step (learning rate 1, no clipping, no schedule) on the same rows. Both losses, before and after
the step, must agree (TRL's ``compute_loss`` on its collated batch; ours in ``eval_mode``).
"""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.config.schema import LoraConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.data import ChatEncoder, build_dataset
from posttrain.models.tiny import build_tokenizer
from posttrain_sft.loss import NLLLoss

pytestmark = [pytest.mark.trl, pytest.mark.ray]
trl = pytest.importorskip("trl", reason="TRL is not installed; the parity tests need trl (1.16)")

ROWS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4, of course"}]},
    {"messages": [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "teal"}]},
]
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def trl_losses(model_path: str, adapter: str, output_dir: str) -> tuple[float, float]:
    """TRL + PEFT's SFT loss on ``ROWS`` before and after one SGD step from ``adapter``."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), adapter,
                                      is_trainable=True)
    args = trl.SFTConfig(
        output_dir=output_dir, assistant_only_loss=True, max_length=None, report_to=[], use_cpu=True, bf16=False,
        per_device_train_batch_size=len(ROWS), max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
        max_grad_norm=0.0, weight_decay=0.0, save_strategy="no", disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS),
                             processing_class=build_tokenizer())
    inputs = dict(trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))]))
    with torch.no_grad():
        before = trainer.compute_loss(trainer.model, inputs).item()
    trainer.train()
    with torch.no_grad():
        after = trainer.compute_loss(trainer.model, inputs).item()
    return before, after


def test_lora_sft_step_equals_trl_with_peft(tmp_path, tiny_model_path, ray_cluster):
    from posttrain.distributed import VirtualCluster
    from posttrain_dtensor.policy import DTensorPolicy

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    batch = build_dataset(path, "sft", ChatEncoder(build_tokenizer())).collate(range(len(ROWS)))
    config = RunConfig(seed=0, policy=PolicyConfig(
        model=tiny_model_path, train_global_batch_size=len(ROWS), train_micro_batch_size=len(ROWS),
        logprob_micro_batch_size=len(ROWS), max_total_sequence_length=64, max_grad_norm=None,
        optimizer=OptimizerConfig(name="sgd", lr=1.0), resources=WorkerResources(cpus=0.5), lora=LORA,
    ))
    cluster = VirtualCluster(config.cluster)
    policy = DTensorPolicy(config, cluster, name="lora-sft")
    try:
        policy.export_hf(str(tmp_path / "adapter"))
        before = policy.train(batch, NLLLoss(), eval_mode=True)["loss"]
        policy.train(batch, NLLLoss())
        after = policy.train(batch, NLLLoss(), eval_mode=True)["loss"]
    finally:
        policy.shutdown()
        cluster.shutdown()

    trl_before, trl_after = trl_losses(tiny_model_path, str(tmp_path / "adapter"), str(tmp_path / "trl"))
    assert before == pytest.approx(trl_before, rel=1e-4)
    assert after == pytest.approx(trl_after, rel=1e-4)
    assert after < before - 0.05, "the step did not lower the loss enough to tell an update from none"
