"""Parity with TRL's DPOTrainer: same pairs, same completion masks, same loss and rewards.

TRL's path: ``DPOTrainer`` (policy = tiny model seed 0, an explicit reference model = tiny
model seed 1) tokenises the conversational preference rows itself, ``trainer.data_collator``
builds its batch (chosen rows first, rejected rows after), and
``trainer.compute_loss(model, inputs)`` runs its real loss code, reference forward included.
No training step: the trainer's own loss method on a prepared batch is the lightest path that
runs TRL's code. Our side gets the same weights' logprobs as ``logprobs`` and
``reference_logprobs`` and our interleaved batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.data import ChatEncoder, build_dataset
from posttrain.models.tiny import build_tokenizer
from posttrain_dpo.loss import DPOLoss

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl", reason="TRL is not installed; the parity tests need trl (1.16)")


BETA = 0.1


@pytest.mark.parametrize(("trl_loss_type", "ours"), [
    ("sigmoid", dict(loss_type="sigmoid")),
    ("ipo", dict(loss_type="ipo", average_log_probs=True)),  # TRL's IPO averages over completion tokens
    ("hinge", dict(loss_type="hinge")),
    ("robust", dict(loss_type="robust", label_smoothing=0.2)),
    ("bco_pair", dict(loss_type="bco_pair")),
    ("apo_zero", dict(loss_type="apo_zero")),
    ("apo_down", dict(loss_type="apo_down")),
    ("sppo_hard", dict(loss_type="sppo_hard")),
])
def test_dpo_equals_trl(tmp_path, tiny_lm, hf_logprobs, trl_loss_type, ours, preference_rows):
    from datasets import Dataset

    tokenizer = build_tokenizer()
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=[trl_loss_type], max_length=None, report_to=[],
        use_cpu=True, bf16=False, per_device_train_batch_size=len(preference_rows),
        label_smoothing=ours.get("label_smoothing", 0.0),
    )
    trainer = trl.DPOTrainer(model=tiny_lm(0), ref_model=tiny_lm(1), args=args,
                             train_dataset=Dataset.from_list(preference_rows), processing_class=tokenizer)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(preference_rows))])
    trainer.model.train()  # TRL files metrics by mode; the tiny model has no dropout
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(inputs)).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in preference_rows))
    batch = build_dataset(path, "preference", ChatEncoder(tokenizer)).collate(range(len(preference_rows)))
    n, width = len(preference_rows), batch["input_ids"].shape[1]
    trl_order = [i // 2 + (i % 2) * n for i in range(2 * n)]  # ours interleaves, TRL stacks chosen then rejected
    assert torch.equal(batch["input_ids"], inputs["input_ids"][trl_order, :width])
    assert torch.equal(batch["token_mask"].long(), inputs["completion_mask"][trl_order, :width])

    with torch.no_grad():
        batch["reference_logprobs"] = hf_logprobs(tiny_lm(1), batch)
        logprobs = hf_logprobs(tiny_lm(0), batch)
    loss, metrics = DPOLoss(beta=BETA, **ours)(logprobs, batch, batch["sample_mask"].sum(), batch["token_mask"].sum())
    assert loss.item() == pytest.approx(trl_loss, rel=1e-5)
    if trl_loss_type == "sigmoid":  # TRL's rewards use summed logprobs
        for name, trl_name in [("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                               ("reward_margin", "rewards/margins"), ("accuracy", "rewards/accuracies"),
                               ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")]:
            assert metrics[name] == pytest.approx(trl_metrics[trl_name], rel=1e-5, abs=1e-6), name
