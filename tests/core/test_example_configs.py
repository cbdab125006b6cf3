"""Every shipped example config loads, types and validates against the installed plugins."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
ALGORITHM = {"sft.yaml": "sft", "dpo.yaml": "dpo", "rm.yaml": "rm", "grpo_math_tiny.yaml": "grpo", "grpo_math_1b_gpu.yaml": "grpo",
             "vlm_counting_sft.yaml": "sft", "vlm_counting_grpo.yaml": "grpo"}
REQUIRED = ["policy.model=/models/any", "data.train=/data/train.jsonl", "data.validation=/data/val.jsonl"]


@pytest.mark.parametrize("name", sorted(ALGORITHM))
def test_example_config_validates(name):
    config = load_config(CONFIGS / name, [*REQUIRED, f"algorithm={ALGORITHM[name]}"])
    assert config.algorithm == ALGORITHM[name]
    assert config.policy.model == "/models/any"
    assert config.section(ALGORITHM[name]) is not None


def test_every_runnable_example_is_covered():
    runnable = {p.name for p in CONFIGS.glob("*.yaml")} - {"supervised_base.yaml"}
    assert runnable == set(ALGORITHM)
