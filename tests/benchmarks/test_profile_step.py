"""benchmarks/profile_step.py, run as a user runs it on a GRPO benchmark's spec (tiny model, a
subprocess): it times the steps without the profiler and under it, and refuses more steps
than the spec's data holds instead of dividing by steps that never ran."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import grpo  # noqa: E402


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    """The spec ``benchmarks/grpo.py --model tiny --steps 2 --max-len 128`` writes
    (:func:`common.make_spec`): one warm-up and two timed steps, so its data holds three batches."""
    folder = tmp_path_factory.mktemp("profile_step")
    args = common.parse_args(grpo.WORKLOAD, ["--model", "tiny", "--steps", "2", "--max-len", "128"])
    path = folder / "spec.json"
    path.write_text(json.dumps(common.make_spec(grpo.WORKLOAD, args, folder)))
    return path


def profile_step(spec_path: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "profile_step.py"), "--spec", str(spec_path), "--steps", str(steps), *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_steps_are_timed_without_the_profiler_and_under_it(spec_path):
    run = profile_step(spec_path, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("mode:"))
    found = re.fullmatch(
        r"mode: packed; step ([\d.]+) s \(([\d.]+)x the floor ([\d.]+) s: [\d.]+ GFLOP at [\d.]+ GFLOP/s\); "
        r"([\d.]+) s under the profiler; load [\d.]+", line,
    )
    assert found, line
    step, ratio, floor, profiled = (float(found.group(i)) for i in range(1, 5))
    assert step > 0 and profiled > 0 and floor > 0
    # step / floor, from the three numbers as printed (seconds to 3 decimals, the ratio to 2):
    # the tiny model's floor is about 0.012 s, so its rounding alone moves the ratio by 4%
    half_ms, half_hundredth = 5e-4, 5e-3
    low = (step - half_ms) / (floor + half_ms) - half_hundredth
    high = (step + half_ms) / (floor - half_ms) + half_hundredth
    assert low <= ratio <= high, (ratio, step, floor)
    assert "aten::mm" in run.stdout  # the profiled steps' operator table


def test_more_steps_than_the_data_holds_are_refused(spec_path):
    run = profile_step(spec_path, 3)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        f"{spec_path}: its data holds 3 batches of 128 rows; --steps 3 needs 4 (one warm-up step first). "
        "Use --steps 2 or less."
    )


def test_row_sizes_are_compared_on_the_same_steps_alternating(spec_path):
    run = profile_step(spec_path, 2, "--row-tokens", "4096,512", "--reps", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if "seconds per step by tokens per packed row" in line)
    rows = [line.split() for line in lines[header + 1:]]
    assert [row[0] for row in rows] == ["4096", "512"], lines
    for row in rows:
        times = [float(t) for t in row[2:]]
        assert len(times) == 4 and all(t > 0 for t in times), row  # 2 rounds x 2 steps
        middle = sorted(times)[1:3]  # the median of four, from times printed to 2 decimals
        assert float(row[1]) == pytest.approx(sum(middle) / 2, abs=0.006), row
    assert "aten::mm" not in run.stdout  # no profile in this mode
