"""Deterministic mode on CPU: two runs with the same seed log bit-identical metrics at every
step (timings aside); a different seed changes them, so the comparison can fail.

- SFT on the dtensor backend (data shuffled by the seed), with validation;
- GRPO (slow): sampling in the hf generation actor, math rewards, clipped policy gradient.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_grpo.config import GRPOConfig
from tests.e2e.test_faults import sft_config, write_corpus
from tests.e2e.test_grpo_e2e import make_config, seven_rows, write_rows

pytestmark = pytest.mark.ray

#: Prefixes of metrics that measure time (``time`` included: when the record was written).
TIMING_PREFIXES = ("timing/", "throughput/", "refit/seconds", "step_time_s", "tokens_per_s", "time")


def untimed_records(run_dir: Path) -> list[dict]:
    """Every metrics record, in order, without the metrics that measure time."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in read_metrics(run_dir / "metrics.jsonl")]


def assert_identical(first: list[dict], second: list[dict]) -> None:
    assert [(r["phase"], r["step"]) for r in first] == [(r["phase"], r["step"]) for r in second]
    for a, b in zip(first, second, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_sft_runs_with_one_seed_are_bit_identical(ray_cluster, tiny_model_path, tmp_path):
    train = write_corpus(tmp_path / "train.jsonl", 32)

    def run(name: str, seed: int) -> list[dict]:
        config = sft_config(tiny_model_path, train, tmp_path / name, save_period=100)
        section = attrs.evolve(config.section("sft"), max_num_steps=3, val_period=3)
        config = attrs.evolve(
            config, seed=seed, deterministic=True, data=attrs.evolve(config.data, validation=train),
            sections={**config.sections, "sft": section},
        )
        run_algorithm(config)
        return untimed_records(tmp_path / name)

    first, second = run("first", 0), run("second", 0)
    assert [(r["phase"], r["step"]) for r in first] == [("train", 1), ("train", 2), ("train", 3), ("validation", 3)]
    assert_identical(first, second)
    other = run("other_seed", 1)  # another data order
    assert [r["loss"] for r in other] != [r["loss"] for r in first]


@pytest.mark.slow
def test_grpo_runs_with_one_seed_are_bit_identical(ray_cluster, tiny_model_path, tmp_path):
    train = write_rows(tmp_path / "train.jsonl", seven_rows(16))
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2)

    def run(name: str, seed: int) -> list[dict]:
        run_algorithm(make_config(tiny_model_path, tmp_path / name, train, grpo, seed=seed, deterministic=True))
        return untimed_records(tmp_path / name)

    first, second = run("first", 3), run("second", 3)
    assert [r["step"] for r in first] == [1, 2]
    assert_identical(first, second)
    other = run("other_seed", 4)  # other samples
    assert [r["loss"] for r in other] != [r["loss"] for r in first]
