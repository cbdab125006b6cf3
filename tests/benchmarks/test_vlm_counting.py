"""The seed table of docs/vision.md is benchmarks/vlm_counting.py's rendering of its committed
results file: three seeds, each GRPO run to its last step, no digit typed by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import vlm_counting  # noqa: E402


def test_the_docs_table_is_the_rendered_results_file():
    results = json.loads(vlm_counting.RESULTS.read_text())
    assert [row["seed"] for row in results["rows"]] == [0, 1, 2]
    assert all(row["grpo steps"] == 256 for row in results["rows"])
    assert all(0.0 <= row[name] <= 1.0 for row in results["rows"] for name in ("after SFT", "after GRPO"))
    assert vlm_counting.table(results) in (REPO / "docs" / "vision.md").read_text()
