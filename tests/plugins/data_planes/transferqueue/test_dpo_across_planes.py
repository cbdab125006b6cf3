"""The supervised loop (SFT and DPO) moves its batches through the data plane too: the same
DPO run with the in-memory plane and with TransferQueue logs the same training and
validation metrics. Two data-parallel workers fetch their own shards from TransferQueue for
the reference pass (whose logprobs they write back) and for training.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transfer_queue", reason="transferqueue is not installed (pip install posttrain-transferqueue)")

from posttrain.run.context import run_algorithm  # noqa: E402
from posttrain.run.metrics import read_metrics  # noqa: E402
from posttrain_transferqueue.runtime import controller_running  # noqa: E402
from tests.plugins.algorithms.dpo.test_algorithm import dpo_config, write_pairs  # noqa: E402

pytestmark = [pytest.mark.transferqueue, pytest.mark.ray]

#: Metrics, by exact name, that measure time; excluded from the comparison.
TIMING_NAMES = ("time", "time_s", "step_time_s", "tokens_per_s")


def untimed(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in TIMING_NAMES}


def test_dpo_logs_identical_metrics_with_either_plane(ray_cluster, tiny_model_path, tmp_path):
    train, val = write_pairs(tmp_path / "train.jsonl", 16, seed=1), write_pairs(tmp_path / "val.jsonl", 4, seed=2)
    records = {}
    for plane in ("memory", "transferqueue"):
        run_dir = tmp_path / plane
        config = dpo_config(tiny_model_path, run_dir, "policy.num_workers=2", f"data_plane.backend={plane}",
                            "dpo.max_num_steps=2", "dpo.val_period=2", train=train, val=val)
        run_algorithm(config)
        records[plane] = read_metrics(run_dir / "metrics.jsonl")
    memory, queue = records["memory"], records["transferqueue"]
    assert [(r["phase"], r["step"]) for r in memory] == [("validation", 0), ("train", 1), ("train", 2),
                                                         ("validation", 2)]
    assert [(r["phase"], r["step"]) for r in queue] == [(r["phase"], r["step"]) for r in memory]
    for expected, found in zip(memory, queue, strict=True):
        assert untimed(found) == untimed(expected), f"{expected['phase']} step {expected['step']}"
    assert memory[2]["loss"] != memory[1]["loss"]  # the first step moved the weights
    assert not controller_running(), "the run's TransferQueue (and every partition in it) outlived the run"
