"""Parity with TRL's SFTTrainer: same tokens, same assistant-only mask, same loss.

TRL's path: ``SFTTrainer(..., assistant_only_loss=True)`` prepares the dataset with its own
chat-template tokenisation, ``trainer.data_collator`` pads a batch, and
``trainer.compute_loss(model, inputs)`` runs its real loss code (fused LM head, mean NLL
over label tokens). No training step and no optimizer: constructing the trainer on the
in-memory tiny model and calling ``compute_loss`` is the lightest path that runs TRL's own
code end to end.
"""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.data import ChatEncoder, build_dataset
from posttrain.models.tiny import build_tokenizer
from posttrain_sft.loss import NLLLoss

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl", reason="TRL is not installed; the parity tests need trl (1.16)")

ROWS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"messages": [
        {"role": "system", "content": "be short"}, {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]},
    {"messages": [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "teal"}]},
]


def test_nll_equals_trl_sft_loss(tmp_path, tiny_lm, hf_logprobs):
    from datasets import Dataset

    tokenizer = build_tokenizer()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"), assistant_only_loss=True, max_length=None, report_to=[],
        use_cpu=True, bf16=False, per_device_train_batch_size=len(ROWS),
    )
    trainer = trl.SFTTrainer(model=tiny_lm(0), args=args, train_dataset=Dataset.from_list(ROWS),
                             processing_class=tokenizer)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(inputs)).item()

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    batch = build_dataset(path, "sft", ChatEncoder(tokenizer)).collate(range(len(ROWS)))
    width = batch["input_ids"].shape[1]
    assert torch.equal(batch["input_ids"], inputs["input_ids"][:, :width])
    assert torch.equal(batch["token_mask"].bool(), inputs["labels"][:, :width] != -100)

    with torch.no_grad():
        logprobs = hf_logprobs(tiny_lm(0), batch)
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    loss, _ = NLLLoss()(logprobs, batch, batch["sample_mask"].sum(), mask.sum())
    assert loss.item() == pytest.approx(trl_loss, rel=1e-5)
