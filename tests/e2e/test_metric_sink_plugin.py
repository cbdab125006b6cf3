"""A metric sink from outside is one small plugin: a CSV sink of a few lines, registered with
the run's plugin host, receives every training step's and validation pass's metrics of a
real run, the same records, in the same order, as core's ``metrics.jsonl``."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from posttrain import hookimpl
from posttrain.config import config_from_dict
from posttrain.plugins import new_plugin_host
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from tests.e2e.test_faults import write_corpus

pytestmark = pytest.mark.ray


# ----------------------------------------------------------------------------- the plugin


class CsvSink:
    """One row per metric: the write's number, step, phase, name and value."""

    def __init__(self, path: Path):
        self.file = open(path, "w", newline="")
        self.rows = csv.writer(self.file)
        self.writes = 0

    def write(self, step, metrics, phase):
        self.rows.writerows([self.writes, step, phase, name, repr(value)] for name, value in metrics.items())
        self.writes += 1

    def close(self):
        self.file.close()


class CsvSinkPlugin:
    @hookimpl
    def posttrain_metric_sinks(self):
        return {"csv": lambda config, run_dir: CsvSink(run_dir / "metrics.csv")}


# ----------------------------------------------------------------------------- the test


def csv_records(path: Path) -> list[dict]:
    records: dict[int, dict] = {}
    for write, step, phase, name, value in csv.reader(path.open(newline="")):
        records.setdefault(int(write), {"step": int(step), "phase": phase})[name] = float(value)
    return [records[k] for k in sorted(records)]


def same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_a_csv_sink_plugin_receives_every_record_of_metrics_jsonl(tiny_model_path, ray_cluster, tmp_path):
    train = write_corpus(tmp_path / "train.jsonl", 24)
    validation = write_corpus(tmp_path / "validation.jsonl", 8)
    config = config_from_dict({
        "algorithm": "sft",
        "seed": 0,
        "run_dir": str(tmp_path / "run"),
        "policy": {
            "model": tiny_model_path,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 8,
            "max_total_sequence_length": 64,
            "resources": {"cpus": 1},
        },
        "data": {"train": train, "validation": validation},
        "logger": {"progress_bar": False},
        "checkpointing": {"enabled": False},
        "sft": {"max_num_steps": 3, "val_period": 2, "val_at_start": True},
    })
    host = new_plugin_host()
    host.register(CsvSinkPlugin(), name="csv-sink")
    run_algorithm(config, host)

    expected = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["phase"], r["step"]) for r in expected] == [
        ("validation", 0), ("train", 1), ("train", 2), ("validation", 2), ("train", 3), ("validation", 3)
    ]
    found = csv_records(tmp_path / "run" / "metrics.csv")
    assert [r.keys() for r in found] == [r.keys() for r in expected]
    for got, want in zip(found, expected, strict=True):
        assert all(same_value(got[k], float(want[k])) for k in want if k not in ("step", "phase")), (got, want)
