"""benchmarks/chaos.py with four fixed kills of a 15-step GRPO run: the driver with SIGKILL while
it writes a checkpoint (the command run again resumes from the last complete one), the driver
with SIGTERM (it saves, exits 143 within 30 s, and the command run again resumes), the policy
worker during a validation pass (the run restarts itself from the checkpoint before it, trains
the step again and validates it once) and a verifier process (the run goes on).
The finished run's training and validation metrics (a pass every 5 steps) equal an
uninterrupted run's, times and the count of samples sent to the environment again aside, and
no Ray process of any exit outlives it by more than ``LEFT_BEHIND_S``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def test_fixed_kills_stop_cleanly_or_restart_and_the_run_ends_as_if_never_killed(tiny_model_path, tmp_path):
    spec = importlib.util.spec_from_file_location("chaos", SCRIPT)
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)

    kills = [chaos.Kill("driver-save", 2, 0.0), chaos.Kill("driver-term", 1, 0.3),
             chaos.Kill("policy", 1, 0.0, during="validation"), chaos.Kill("verifier", 1, 0.1)]
    result = chaos.run_chaos(kills, 15, tmp_path, Path(tiny_model_path))

    outcomes = {kill["kill"]["target"]: kill for kill in result["kills"]}
    assert outcomes["driver-save"]["result"] == "exited -9", outcomes  # killed while a tmp_step_N folder existed
    assert outcomes["policy"]["result"] == "restarted" and outcomes["policy"]["validating"], outcomes
    assert outcomes["verifier"]["result"] in ("went on", "missed (no such process now)"), outcomes
    term = outcomes["driver-term"]
    assert term["result"] == "exited 143" and term["seconds"] < 30, outcomes
    assert term["message"].startswith("stopped: stopped by SIGTERM after step "), outcomes
    assert not any(kill["left_behind"] for kill in result["kills"]), outcomes
    assert result["final_exit"] == 0 and result["steps_logged"] == list(range(1, 16)), result
    assert result["validations_logged"] == [5, 10, 15], result  # every 5 steps
    assert not result["left_behind_at_end"], result
    assert result["matched"], result
