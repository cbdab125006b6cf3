"""The Bradley-Terry loss: parity with TRL's RewardTrainer on the same pairs and weights, an
independent float64 computation (masks, centring, metrics), and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.batch import Batch
from posttrain.data import ChatEncoder, build_dataset
from posttrain.models.tiny import build_tokenizer, tiny_llama_config
from posttrain_rm.loss import BradleyTerryLoss, sequence_scores


def tiny_reward_model(seed: int):
    """A seeded tiny Llama sequence classifier with one label (what a value-head policy exports)."""
    from transformers import LlamaForSequenceClassification

    config = tiny_llama_config(len(build_tokenizer()))
    config.num_labels = 1
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config).eval()


def position_values(model, batch: Batch) -> torch.Tensor:
    """The value head at every position: the score layer on each final hidden state, 0 on padding."""
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=valid.long()).last_hidden_state
    return (hidden @ model.score.weight.T)[..., 0] * valid


def preference_batch(tmp_path, rows) -> Batch:
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_dataset(path, "preference", ChatEncoder(build_tokenizer())).collate(range(len(rows)))


@pytest.mark.trl
@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_equals_trl_reward_trainer(tmp_path, center, preference_rows):
    trl = pytest.importorskip("trl", reason="TRL is not installed; the parity tests need trl (1.16)")
    from datasets import Dataset

    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                            center_rewards_coefficient=center, per_device_train_batch_size=len(preference_rows), max_length=None)
    trainer = trl.RewardTrainer(model=tiny_reward_model(0), args=args, train_dataset=Dataset.from_list(preference_rows),
                                processing_class=build_tokenizer())
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(preference_rows))])
    trainer.model.train()  # TRL files metrics by mode; the tiny model has no dropout
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(inputs)).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    batch = preference_batch(tmp_path, preference_rows)
    n, width = len(preference_rows), batch["input_ids"].shape[1]
    trl_order = [i // 2 + (i % 2) * n for i in range(2 * n)]  # ours interleaves, TRL stacks chosen then rejected
    assert torch.equal(batch["input_ids"], inputs["input_ids"][trl_order, :width])  # the same sequences
    with torch.no_grad():
        values = position_values(trainer.model, batch)
    loss, metrics = BradleyTerryLoss(center)(values, batch, batch["sample_mask"].sum(), batch["token_mask"].sum())
    assert loss.item() == pytest.approx(trl_loss, rel=1e-4)
    assert metrics["accuracy"] == pytest.approx(trl_metrics["accuracy"], abs=1e-6)
    assert metrics["margin"] == pytest.approx(trl_metrics["margin"], rel=1e-4, abs=1e-6)


def test_loss_and_gradient_equal_a_float64_computation_with_masks_and_microbatches():
    torch.manual_seed(0)
    values = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([6, 3, 2, 5, 4, 4, 1, 6])
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # pair 1 is dropped, as the data drops pairs
    batch = Batch(input_lengths=lengths, sample_mask=sample_mask, token_mask=torch.ones(8, 6))
    coefficient = 0.1

    def reference(v: torch.Tensor) -> torch.Tensor:
        total = v.new_zeros(())
        kept = 0
        for pair in range(4):
            c, r = 2 * pair, 2 * pair + 1
            if sample_mask[c] * sample_mask[r] == 0:
                continue
            sc, sr = v[c, lengths[c] - 1], v[r, lengths[r] - 1]
            total = total + torch.log1p(torch.exp(-(sc - sr))) + coefficient * (sc + sr) ** 2
            kept += 1
        return total / kept

    expected = reference(values)
    (grad_expected,) = torch.autograd.grad(expected, values)
    loss_fn = BradleyTerryLoss(coefficient)
    seqs, toks = sample_mask.sum(), torch.tensor(48.0)
    parts = [loss_fn(values[rows], batch.select(list(range(rows.start, rows.stop))), seqs, toks)
             for rows in (slice(0, 4), slice(4, 8))]  # two microbatches of two pairs
    loss = parts[0][0] + parts[1][0]
    (grad,) = torch.autograd.grad(loss, values)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(grad, grad_expected, rtol=1e-10, atol=1e-12)
    scores = sequence_scores(values.detach(), lengths)
    accuracy = sum(float(scores[2 * p] > scores[2 * p + 1]) for p in (0, 2, 3)) / 3
    assert parts[0][1]["accuracy"] + parts[1][1]["accuracy"] == pytest.approx(accuracy)
    margin = sum(float(scores[2 * p] - scores[2 * p + 1]) for p in (0, 2, 3)) / 3
    assert parts[0][1]["margin"] + parts[1][1]["margin"] == pytest.approx(margin)


def test_an_odd_microbatch_is_refused():
    batch = Batch(input_lengths=torch.tensor([2, 2, 2]), sample_mask=torch.ones(3))
    with pytest.raises(ValueError, match="got a microbatch of 3 rows. Use an even micro batch size."):
        BradleyTerryLoss()(torch.zeros(3, 2), batch, torch.tensor(3.0), torch.tensor(6.0))
