"""DPO of a vision-language model (tiny Qwen2-VL and Idefics3) on image preference rows end to end: the
prompt shows coloured squares (:mod:`posttrain.testing.shapes`), the chosen answer is their
count and the rejected one is off by one. Step 1's loss is ln 2 (policy = reference, images
included on both sides), and after training every pair prefers its chosen answer."""

from __future__ import annotations

import json
import math

import pytest

from posttrain.config import config_from_dict
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain.testing.shapes import write_counting_rows

STEPS = 8

pytestmark = pytest.mark.ray


def preference_rows(folder) -> str:
    """The counting rows as pairs: chosen the count, rejected the count plus one."""
    sft = write_counting_rows(folder, 8, seed=5)
    pairs = []
    for line in sft.read_text().splitlines():
        user, answer = json.loads(line)["messages"]
        pairs.append({"prompt": [user], "chosen": answer["content"], "rejected": str(int(answer["content"]) + 1)})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return str(path)


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3"])
def records(request, zoo_model, ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm_dpo")
    pairs = preference_rows(folder)
    tree = {
        "algorithm": "dpo",
        "seed": 0,
        "run_dir": str(folder / "run"),
        "policy": {
            "model": zoo_model(request.param),
            "train_global_batch_size": 8,  # 4 pairs
            "train_micro_batch_size": 4,
            "max_total_sequence_length": 96,
            "sequence_packing": {"enabled": True, "max_tokens_per_row": 192},
            "optimizer": {"name": "adamw", "lr": 2e-3},
            "resources": {"cpus": 0.5},
        },
        "data": {"train": pairs, "validation": pairs},
        "logger": {"progress_bar": False},
        "checkpointing": {"enabled": False},
        "dpo": {"beta": 0.1, "max_num_steps": STEPS, "max_num_epochs": 4, "val_period": STEPS, "val_at_start": True},
    }
    run_algorithm(config_from_dict(tree, []))
    return read_metrics(folder / "run" / "metrics.jsonl")


def test_the_first_loss_is_ln2_and_every_pair_ends_preferring_its_chosen_answer(records):
    train = [r for r in records if r["phase"] == "train"]
    val = [r for r in records if r["phase"] == "validation"]
    assert [r["step"] for r in val] == [0, STEPS]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert val[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert val[-1]["accuracy"] == 1.0 and val[-1]["loss"] < 0.6
