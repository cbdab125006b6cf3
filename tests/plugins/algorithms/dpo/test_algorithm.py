"""The DPO loop end to end on the dtensor backend, and chosen/rejected pairs kept together.

A learnable preference set: four random letters as the prompt, chosen always ``yes``,
rejected always ``no``.
"""

from __future__ import annotations

import json
import math
import random
import string

import pytest
import torch

from posttrain.backend.work import Batching, plan_pass
from posttrain.batch import Batch
from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain.run.context import RunContext, run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_dpo.loss import DPOLoss

STEPS = 8


def write_pairs(path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choices(string.ascii_lowercase, k=4))
            f.write(json.dumps({"prompt": prompt, "chosen": "yes", "rejected": "no"}) + "\n")
    return str(path)


def dpo_config(model: str, run_dir, *overrides: str, train: str | None = None, val: str | None = None, **dpo):
    tree = {
        "algorithm": "dpo",
        "seed": 0,
        "run_dir": str(run_dir),
        "policy": {
            "model": model,
            "train_global_batch_size": 8,  # 4 pairs
            "train_micro_batch_size": 4,
            "logprob_micro_batch_size": 3,  # odd on purpose: reference scoring has no pairing constraint
            "max_total_sequence_length": 32,
            "sequence_packing": {"enabled": True, "max_tokens_per_row": 64},
            "optimizer": {"name": "adamw", "lr": 2e-3},
            "resources": {"cpus": 0.5},
        },
        "data": {"train": train, "validation": val},
        "logger": {"progress_bar": False},
        "checkpointing": {"enabled": False},
        "dpo": {"beta": 0.1, "max_num_steps": STEPS, "val_period": 4, "val_at_start": True, **dpo},
    }
    return config_from_dict(tree, list(overrides))


@pytest.fixture(scope="module")
def dpo_run(tiny_model_path, ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo")
    train, val = write_pairs(folder / "train.jsonl", 32, seed=1), write_pairs(folder / "val.jsonl", 6, seed=2)
    run_algorithm(dpo_config(tiny_model_path, folder / "run", train=train, val=val))
    return read_metrics(folder / "run" / "metrics.jsonl")


@pytest.mark.ray
def test_first_step_loss_is_ln2_and_preference_accuracy_rises(dpo_run):
    train = [r for r in dpo_run if r["phase"] == "train"]
    val = [r for r in dpo_run if r["phase"] == "validation"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and [r["step"] for r in val] == [0, 4, 8]
    # Policy == reference before the first update: every log-ratio is 0, the loss ln 2.
    for first in (train[0], val[0]):
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert abs(first["reward_margin"]) < 1e-6
    # At the start every margin is 0 (a tie, not a preference); after training every pair
    # prefers the chosen answer, with a margin far above the start's.
    assert val[-1]["accuracy"] == train[-1]["accuracy"] == 1.0
    assert val[-1]["rewards_chosen"] > 0.2 and val[-1]["rewards_rejected"] < -0.2
    assert val[-1]["reward_margin"] > 0.5
    assert val[-1]["loss"] < 0.45


# ---------------------------------------------------------------------- pairs stay together

#: Row lengths chosen so that length-balanced sharding and packing of single rows would
#: separate chosen (even) from rejected (odd) rows.
PAIR_LENGTHS = [30, 5, 6, 28, 12, 12, 4, 20, 25, 3, 9, 9, 7, 26, 14, 2]


def _pairs_intact(rows: list[int]) -> bool:
    return len(rows) % 2 == 0 and all(rows[k] % 2 == 0 and rows[k + 1] == rows[k] + 1 for k in range(0, len(rows), 2))


@pytest.mark.parametrize(
    "batching",
    [Batching(4), Batching(4, packing_tokens_per_row=64), Batching(4, dynamic_max_tokens=120)],
    ids=["fixed", "packed", "dynamic"],
)
def test_dtensor_plan_keeps_pairs_together(batching):
    """Every rank and every microbatch holds whole pairs, chosen then rejected; without the
    grouping the same lengths are split (so this test can fail)."""
    for dp in (1, 2):
        plan = plan_pass(PAIR_LENGTHS, dp, batching, row_group_size=2)
        assert sorted(i for shard in plan.shards for i in shard) == list(range(len(PAIR_LENGTHS)))
        for shard, microbatches in zip(plan.shards, plan.microbatches, strict=True):
            assert _pairs_intact(shard)
            assert sorted(i for mb in microbatches for i in mb) == list(range(len(shard)))
            for mb in microbatches:
                assert _pairs_intact([shard[i] for i in mb])
                if batching.packing_tokens_per_row:
                    assert sum(PAIR_LENGTHS[shard[i]] for i in mb) <= batching.packing_tokens_per_row
    if batching.packing_tokens_per_row or batching.dynamic_max_tokens:
        ungrouped = plan_pass(PAIR_LENGTHS, 2, batching)
        assert not all(_pairs_intact([s[i] for i in mb]) for s, mbs in zip(ungrouped.shards, ungrouped.microbatches, strict=True)
                       for mb in mbs)


def pair_batch(lengths: list[int], seed: int = 0) -> Batch:
    """Random token rows with the first 3 tokens as prompt, one pair (rows 10, 11) masked out,
    and arbitrary per-row reference logprobs, so that each pair's loss depends on its partner."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = max(lengths)
    pos = torch.arange(width)[None, :]
    real = pos < lens[:, None]
    token_mask = (real & (pos >= 3)).float()
    sample_mask = torch.ones(len(lengths))
    sample_mask[10:12] = 0
    return Batch(
        input_ids=torch.randint(7, 100, (len(lengths), width), generator=g) * real,
        input_lengths=lens,
        token_mask=token_mask,
        sample_mask=sample_mask,
        reference_logprobs=-torch.rand(len(lengths), width, generator=g) * 3 * token_mask,
    )


@pytest.mark.ray
def test_data_parallel_packed_dpo_loss_equals_a_single_process_reference(tiny_model_path, ray_cluster, tmp_path):
    """dp=2 with packing: the policy's DPO loss and metrics equal DPOLoss over the whole batch
    at once on a plain transformers float64 forward; a split or reordered pair would fail
    (odd microbatch) or pair the wrong rows (a different value)."""
    from transformers import AutoModelForCausalLM

    config = dpo_config(tiny_model_path, tmp_path, "policy.num_workers=2", "policy.train_global_batch_size=16")
    batch = pair_batch(PAIR_LENGTHS)
    loss_fn = DPOLoss(beta=0.5)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    logprobs = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for i, n in enumerate(PAIR_LENGTHS):
            ids = batch["input_ids"][i : i + 1, :n]
            logprobs[i, 1:n] = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    logprobs *= batch["token_mask"].double()
    valid_seqs = batch["sample_mask"].double().sum()
    valid_toks = (batch["token_mask"].double() * batch["sample_mask"].double()[:, None]).sum()
    want_loss, want = loss_fn(logprobs, Batch({k: v.double() if v.is_floating_point() else v for k, v in batch.items()}),
                              valid_seqs, valid_toks)
    assert 0.2 < want["accuracy"] < 1.0  # pairs differ, so a wrong pairing changes the numbers

    context = RunContext(config)
    policy = context.build_policy()
    try:
        got = policy.train(batch, loss_fn, eval_mode=True)
    finally:
        policy.shutdown()
        context.close()
    assert got["loss"] == pytest.approx(float(want_loss), abs=1e-5)
    for name in ("accuracy", "rewards_chosen", "rewards_rejected", "logps_chosen"):
        assert got[name] == pytest.approx(want[name], abs=1e-4), name


# ---------------------------------------------------------------------- config checks


def test_config_checks_give_the_numbers(tiny_model_path, tmp_path):
    """Pairs: core checks the micro batch with DPO's batch-size rule (whole pairs) and suggests
    sizes that pass every batch rule at once."""
    with pytest.raises(ConfigError) as info:
        dpo_config(tiny_model_path, tmp_path, "policy.num_workers=2", "policy.train_global_batch_size=6",
                   "policy.train_micro_batch_size=3")
    assert str(info.value).startswith(
        "policy.train_micro_batch_size=3 is not a multiple of 2 (whole chosen/rejected pairs of rows). Use "
        "policy.train_micro_batch_size=2 and policy.train_global_batch_size=8 together. Where set: policy.num_workers at "
        "command line override 'policy.num_workers=2';"
    )
    dpo_config(tiny_model_path, tmp_path, "policy.num_workers=2", "policy.train_global_batch_size=8",
               "policy.train_micro_batch_size=2")  # the suggestion passes
    with pytest.raises(ConfigError) as info:
        dpo_config(tiny_model_path, tmp_path, "dpo.val_global_batch_size=5")
    assert str(info.value) == (
        "dpo.val_global_batch_size: expected an even number of rows, found 5; use 6. Where set: "
        "dpo.val_global_batch_size at command line override 'dpo.val_global_batch_size=5'."
    )
    with pytest.raises(ConfigError, match=r"at least 64 tokens, found 40; raise it or lower data.max_length to 20"):
        dpo_config(tiny_model_path, tmp_path, "policy.sequence_packing.max_tokens_per_row=40")
    with pytest.raises(ConfigError, match=r"dpo\.loss: unknown loss 'dop'"):
        dpo_config(tiny_model_path, tmp_path, loss="dop")
