"""The learning comparison of docs/algorithms/loss-reference.md is benchmarks/loss_variants.py's
rendering of its committed results file: three seeds, every variant, no digit typed by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import loss_variants  # noqa: E402


def test_the_docs_table_is_the_rendered_results_file():
    results = json.loads(loss_variants.RESULTS.read_text())
    assert [row["seed"] for row in results["rows"]] == [0, 1, 2]
    names = [loss_variants.BASELINE, *(name for name, _ in loss_variants.VARIANTS.values())]
    assert all(0.0 <= row[name]["accuracy"] <= 1.0 for row in results["rows"] for name in names)
    page = (REPO / "docs" / "algorithms" / "loss-reference.md").read_text()
    assert loss_variants.table(results) in page
