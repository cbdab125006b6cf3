"""The NLL loss against a float64 reference, microbatch accumulation, and registration."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_sft import plugin as sft_plugin
from posttrain_sft.config import SFTConfig
from posttrain_sft.loss import NLLLoss


def random_batch(rows: int = 6, width: int = 9, seed: int = 0) -> tuple[torch.Tensor, Batch]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    positions = torch.arange(width)[None, :]
    token_mask = ((torch.rand(rows, width, generator=g) < 0.7) & (positions < lengths[:, None]) & (positions > 0)).float()
    sample_mask = torch.ones(rows)
    sample_mask[1] = 0.0
    logprobs = -torch.rand(rows, width, generator=g, dtype=torch.float32) * 5
    logprobs[token_mask == 0] = 0.0  # the policy's convention
    return logprobs, Batch(token_mask=token_mask, sample_mask=sample_mask, input_lengths=lengths)


def global_counts(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    return batch["sample_mask"].sum(), mask.sum()


def reference_nll(logprobs: torch.Tensor, batch: Batch) -> float:
    """-sum of the valid tokens' logprobs / their count, one token at a time in float64."""
    total, count = 0.0, 0
    for i in range(logprobs.shape[0]):
        if batch["sample_mask"][i] == 0:
            continue
        for t in range(logprobs.shape[1]):
            if batch["token_mask"][i, t] == 1:
                total -= float(logprobs[i, t].double())
                count += 1
    return total / count


def test_nll_matches_float64_reference():
    logprobs, batch = random_batch()
    loss, metrics = NLLLoss()(logprobs, batch, *global_counts(batch))
    expected = reference_nll(logprobs, batch)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)


def test_microbatches_sum_to_the_full_batch_loss_and_gradient():
    logprobs, batch = random_batch(rows=8, seed=1)
    seqs, toks = global_counts(batch)
    full = logprobs.clone().requires_grad_(True)
    full_loss, full_metrics = NLLLoss()(full, batch, seqs, toks)
    full_loss.backward()

    split = logprobs.clone().requires_grad_(True)
    total, metric_sum = torch.zeros(()), 0.0
    for start in range(0, 8, 3):  # microbatches of 3, 3, 2
        loss, metrics = NLLLoss()(split[start:start + 3], batch.slice(start, start + 3), seqs, toks)
        total = total + loss
        metric_sum += metrics["loss"]
    total.backward()
    assert total.item() == pytest.approx(full_loss.item(), rel=1e-6)
    assert metric_sum == pytest.approx(full_metrics["loss"], rel=1e-6)
    torch.testing.assert_close(split.grad, full.grad)
    # each valid token's gradient is -1/N; everything else gets none
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    torch.testing.assert_close(full.grad, -mask / mask.sum())


def test_masked_minus_infinity_and_empty_batches_stay_finite():
    logprobs, batch = random_batch()
    logprobs[batch["token_mask"] == 0] = float("-inf")
    loss, _ = NLLLoss()(logprobs, batch, *global_counts(batch))
    assert loss.item() == pytest.approx(reference_nll(torch.nan_to_num(logprobs, neginf=0.0), batch), rel=1e-6)
    empty = Batch(token_mask=torch.zeros_like(batch["token_mask"]), sample_mask=batch["sample_mask"])
    loss, _ = NLLLoss()(logprobs, empty, *global_counts(empty))
    assert loss.item() == 0.0


def test_registered_loss_and_config_section():
    host = plugin_host()
    assert isinstance(host.losses["nll"](SFTConfig()), NLLLoss)
    assert host.config_sections["sft"] is SFTConfig
    bad = RunConfig(sections={"sft": SFTConfig(max_num_epochs=0, val_period=-1)})
    with pytest.raises(ConfigError, match=r"sft\.max_num_epochs: expected at least 1, found 0; sft\.val_period: expected 0"):
        sft_plugin.posttrain_validate_config(bad)
