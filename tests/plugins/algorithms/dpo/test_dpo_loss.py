"""DPO losses: ln 2 at the start, every variant against a float64 loop, microbatch accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import RunConfig
from posttrain.data import ChatEncoder, build_dataset
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_tokenizer
from posttrain.plugins import plugin_host
from posttrain_dpo import plugin as dpo_plugin
from posttrain_dpo.config import DPOConfig
from posttrain_dpo.loss import DPOLoss

VARIANTS = {
    "sigmoid": dict(),
    "label_smoothing": dict(label_smoothing=0.2),
    "ipo": dict(loss_type="ipo"),
    "ipo_average": dict(loss_type="ipo", average_log_probs=True),
    "average": dict(average_log_probs=True),
    "reference_free": dict(reference_free=True),
    "sft_mix": dict(sft_weight=0.7),
    "all_sigmoid_options": dict(average_log_probs=True, sft_weight=0.3, label_smoothing=0.1, reference_free=True),
    "sft_sum": dict(sft_weight=0.05, sft_reduction="sum"),
    "hinge": dict(loss_type="hinge", beta=0.4),
    "robust": dict(loss_type="robust", label_smoothing=0.2),
    "bco_pair": dict(loss_type="bco_pair", beta=0.5),
    "apo_zero": dict(loss_type="apo_zero", beta=0.5),
    "apo_down": dict(loss_type="apo_down", beta=0.5),
    "sppo_hard": dict(loss_type="sppo_hard", beta=0.5),
    "sft": dict(loss_type="sft"),
    "sft_sum_only": dict(loss_type="sft", sft_reduction="sum"),
}


def pair_batch(pairs: int = 4, width: int = 10, seed: int = 0, drop_pair: int | None = 1) -> tuple[torch.Tensor, Batch]:
    """Interleaved rows with random loss masks; pair ``drop_pair`` has sample_mask 0."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * pairs
    token_mask = torch.zeros(rows, width)
    for i in range(rows):
        start, stop = sorted(torch.randint(1, width + 1, (2,), generator=g).tolist())
        token_mask[i, start:max(stop, start + 1)] = 1.0
    sample_mask = torch.ones(rows)
    if drop_pair is not None:
        sample_mask[2 * drop_pair: 2 * drop_pair + 2] = 0.0
    logprobs = -torch.rand(rows, width, generator=g) * 3 * token_mask
    reference = -torch.rand(rows, width, generator=g) * 3 * token_mask
    return logprobs, Batch(token_mask=token_mask, sample_mask=sample_mask, reference_logprobs=reference)


def counts(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["sample_mask"].sum(), (batch["token_mask"] * batch["sample_mask"][:, None]).sum()


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def pair_loss_by_hand(kind: str, beta: float, eps: float, c: float, r: float) -> float:
    """One pair's preference loss from its chosen and rejected log-ratios."""
    h = c - r
    if kind == "sigmoid":
        return -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)
    if kind == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return max(0.0, 1 - beta * h)
    if kind == "robust":
        return ((1 - eps) * -logsigmoid(beta * h) - eps * -logsigmoid(-beta * h)) / (1 - 2 * eps)
    if kind == "bco_pair":
        return -logsigmoid(beta * c) - logsigmoid(-beta * r)
    if kind == "apo_zero":
        return 1 - sigmoid(beta * c) + sigmoid(beta * r)
    if kind == "apo_down":
        return sigmoid(beta * c) + 1 - sigmoid(beta * h)
    if kind == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    return 0.0  # sft


def reference_dpo(logprobs: torch.Tensor, batch: Batch, beta: float = 0.1, loss_type: str = "sigmoid",
                  reference_free: bool = False, average_log_probs: bool = False, sft_weight: float = 0.0,
                  label_smoothing: float = 0.0, sft_reduction: str = "mean") -> dict[str, float]:
    """The DPO objective and metrics, one pair and one token at a time, in Python floats (float64)."""

    def sequence(values: torch.Tensor, i: int) -> tuple[float, int]:
        mask = batch["token_mask"][i]
        return sum(float(values[i, t]) for t in range(values.shape[1]) if mask[t] == 1), int(mask.sum())

    totals = dict(loss=0.0, accuracy=0.0, rewards_chosen=0.0, rewards_rejected=0.0)
    pairs = 0
    for k in range(logprobs.shape[0] // 2):
        if batch["sample_mask"][2 * k] == 0:
            continue
        pairs += 1
        ratios = []
        for i in (2 * k, 2 * k + 1):
            policy, n = sequence(logprobs, i)
            ref = 0.0 if reference_free else sequence(batch["reference_logprobs"], i)[0]
            ratios.append((policy - ref) / (n if average_log_probs else 1))
        c, r = ratios
        loss = pair_loss_by_hand(loss_type, beta, label_smoothing, c, r)
        chosen_sum, chosen_n = sequence(logprobs, 2 * k)
        nll = -chosen_sum / (chosen_n if sft_reduction == "mean" else 1)
        loss += (1.0 if loss_type == "sft" else sft_weight) * nll
        totals["loss"] += loss
        totals["accuracy"] += float(ratios[0] > ratios[1])
        totals["rewards_chosen"] += beta * ratios[0]
        totals["rewards_rejected"] += beta * ratios[1]
    return {name: value / pairs for name, value in totals.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_float64_reference(variant):
    options = VARIANTS[variant]
    logprobs, batch = pair_batch(seed=3)
    loss, metrics = DPOLoss(**options)(logprobs, batch, *counts(batch))
    expected = reference_dpo(logprobs, batch, **options)
    assert loss.item() == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
    for name in ("loss", "accuracy", "rewards_chosen", "rewards_rejected"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    assert metrics["reward_margin"] == pytest.approx(expected["rewards_chosen"] - expected["rewards_rejected"], abs=1e-6)


@pytest.mark.parametrize("variant", ["sigmoid", "label_smoothing", "average"])
def test_policy_equal_to_reference_gives_ln2(variant):
    logprobs, batch = pair_batch(seed=4)
    batch["reference_logprobs"] = logprobs.clone()
    loss, metrics = DPOLoss(**VARIANTS[variant])(logprobs, batch, *counts(batch))
    assert abs(loss.item() - math.log(2)) < 1e-6
    assert metrics["accuracy"] == 0.0 and metrics["reward_margin"] == 0.0


def test_step_one_on_a_real_preference_batch_gives_ln2(tmp_path, tiny_lm, hf_logprobs):
    """Policy and reference are the same initial weights, run as two separate forward passes."""
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "2+2", "chosen": "4", "rejected": "5, maybe"}\n'
                    '{"prompt": "sky?", "chosen": "blue", "rejected": "green"}\n')
    batch = build_dataset(path, "preference", ChatEncoder(build_tokenizer())).collate([0, 1])
    with torch.no_grad():
        batch["reference_logprobs"] = hf_logprobs(tiny_lm(0), batch)
        logprobs = hf_logprobs(tiny_lm(0), batch)
    loss, _ = DPOLoss(beta=0.1)(logprobs, batch, *counts(batch))
    assert abs(loss.item() - math.log(2)) < 1e-6


@pytest.mark.parametrize("variant", ["sigmoid", "ipo_average", "all_sigmoid_options", "robust", "sppo_hard", "sft"])
def test_microbatches_sum_to_the_full_batch(variant):
    options = VARIANTS[variant]
    logprobs, batch = pair_batch(pairs=5, seed=5, drop_pair=2)
    seqs, toks = counts(batch)
    full = logprobs.clone().requires_grad_(True)
    full_loss, full_metrics = DPOLoss(**options)(full, batch, seqs, toks)
    full_loss.backward()

    split = logprobs.clone().requires_grad_(True)
    total, metric_sums = torch.zeros(()), dict.fromkeys(full_metrics, 0.0)
    for start in (0, 4, 6):  # microbatches of 2, 1 and 2 pairs
        stop = {0: 4, 4: 6, 6: 10}[start]
        loss, metrics = DPOLoss(**options)(split[start:stop], batch.slice(start, stop), seqs, toks)
        total = total + loss
        for name, value in metrics.items():
            metric_sums[name] += value
    total.backward()
    assert total.item() == pytest.approx(full_loss.item(), rel=1e-6)
    for name, value in full_metrics.items():
        assert metric_sums[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    torch.testing.assert_close(split.grad, full.grad)
    assert split.grad[4:6].abs().sum() == 0  # the dropped pair gets no gradient


def test_unusable_batches_are_refused():
    logprobs, batch = pair_batch()
    with pytest.raises(ValueError, match="DPO needs chosen/rejected pairs .* got a microbatch of 3 rows"):
        DPOLoss()(logprobs[:3], batch.slice(0, 3), *counts(batch))
    del batch["reference_logprobs"]
    with pytest.raises(ValueError, match="DPO needs the batch's 'reference_logprobs'"):
        DPOLoss()(logprobs, batch, *counts(batch))
    DPOLoss(reference_free=True)(logprobs, batch, *counts(batch))  # needs none
    DPOLoss(loss_type="sft")(logprobs, batch, *counts(batch))  # the SFT term alone needs none either


def test_registered_loss_and_config_checks():
    host = plugin_host()
    loss = host.losses["dpo"](DPOConfig(beta=0.3, loss_type="ipo", average_log_probs=True))
    assert isinstance(loss, DPOLoss) and (loss.beta, loss.kind, loss.average_log_probs) == (0.3, "ipo", True)
    assert host.config_sections["dpo"] is DPOConfig
    dpo_plugin.posttrain_validate_config(RunConfig(sections={"dpo": DPOConfig()}))
    bad = RunConfig(sections={"dpo": DPOConfig(beta=0.0, loss_type="ipo", label_smoothing=0.1)})
    with pytest.raises(ConfigError) as info:
        dpo_plugin.posttrain_validate_config(bad)
    assert str(info.value) == (
        "dpo.beta: expected a positive number, found 0.0; "
        "dpo.label_smoothing: applies to loss_type sigmoid and robust only, found dpo.loss_type 'ipo'; remove "
        "dpo.label_smoothing"
    )
    with pytest.raises(ConfigError, match="dpo.loss_type: expected one of sigmoid, ipo, hinge, robust, bco_pair, "
                                          "apo_zero, apo_down, sppo_hard, sft, found 'exo_pair'"):
        dpo_plugin.posttrain_validate_config(RunConfig(sections={"dpo": DPOConfig(loss_type="exo_pair")}))
    with pytest.raises(ConfigError) as info:
        dpo_plugin.posttrain_validate_config(RunConfig(sections={"dpo": DPOConfig(loss_type="sft", sft_weight=0.5,
                                                                                  sft_reduction="token")}))
    assert str(info.value) == (
        "dpo.sft_reduction: expected one of mean, sum, found 'token'; dpo.sft_weight: loss_type sft is the SFT term "
        "alone, with weight 1, so dpo.sft_weight (0.5) would be ignored; remove dpo.sft_weight or choose a "
        "preference loss_type"
    )
    assert host.losses["dpo"](DPOConfig(loss_type="sft")).needs_reference is False


def test_the_sft_loss_type_runs_without_a_reference_policy():
    """loss_type sft needs no reference: the algorithm neither builds the reference weights
    nor scores batches with them."""
    from posttrain_dpo.algorithm import DPO

    class NoReference:
        def logprobs_into(self, *args, **kwargs):
            raise AssertionError("the sft loss type scored a batch with the reference policy")

    samples = object()
    assert DPO().uses_reference(DPOConfig(loss_type="sft")) is False
    assert DPO().uses_reference(DPOConfig()) is True
    assert DPO().prepare_batch(NoReference(), samples, DPOConfig(loss_type="sft")) is samples
