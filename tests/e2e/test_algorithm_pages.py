"""The algorithm pages' commands, as written. The PPO and distillation pages' configs and
commands on the default local cluster of a 2-core machine (``cluster.num_cpus=2`` on any
machine): ``posttrain run ppo --config ppo.yaml`` (policy, critic, engine, math) and
``posttrain run distill --config distill.yaml`` (student, teacher, engine, math) place every
worker group and train, with only the model folder and the run's length changed. With
engines and environments in processes of their own, the groups asked for one CPU more than
the two the machine has and the run waited 120 s to be refused. The other pages' commands
train in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from posttrain.run.metrics import read_metrics
from tests.docs.commands import command_lines
from tests.docs.pages import REPO, blocks

pytestmark = [pytest.mark.ray]

PAGES = {  # page -> (its config's file name, the overrides that shorten the run to two steps)
    "algorithms/ppo.md": ("ppo.yaml", ["grpo.max_num_steps=2", "grpo.val_period=0"]),
    "algorithms/distill.md": ("distill.yaml", ["distill.max_num_steps=2", "distill.val_period=0",
                                               "distill.export_dir=null", "distill.teacher.model={model}"]),
}


@pytest.mark.parametrize("page", list(PAGES))
def test_the_page_runs_as_written_on_two_cores(page, tiny_model_path, tmp_path):
    name, shorter = PAGES[page]
    (config,) = [b.text for b in blocks(page) if b.title == name]
    (tmp_path / name).write_text(config)
    (command,) = [line for b in blocks(page) if b.language == "bash" for line in command_lines(b.text)
                  if line[-2:] == ["--config", name]]
    assert command[:2] == ["posttrain", "run"], command
    run_dir = tmp_path / "run"
    overrides = [f"policy.model={tiny_model_path}", f"run_dir={run_dir}", "cluster.num_cpus=2", "logger.progress_bar=false",
                 *[o.format(model=tiny_model_path) for o in shorter]]
    argv = [*command[1:-1], str(tmp_path / name)]  # from the repository root, as the page's data paths are
    done = subprocess.run([sys.executable, "-m", "posttrain.cli", *argv, *overrides], cwd=REPO,
                          env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl", "train")] == [1, 2]


#: The other algorithm pages' first ``posttrain run`` command, as written, run in this process on
#: the session's Ray cluster (the pages' configs fit 2 cores: tests/docs checks every command's
#: parts against a 2-core machine), with only the model folder, the run's length and where it
#: writes changed.
IN_PROCESS = {
    "algorithms/sft.md": ["sft.max_num_steps=2", "sft.export_dir={out}/hf"],
    "algorithms/dpo.md": ["dpo.max_num_steps=2"],
    "algorithms/rm.md": ["rm.max_num_steps=2", "rm.export_dir={out}/hf"],
    "algorithms/grpo.md": ["grpo.max_num_steps=2", "grpo.val_period=0"],
}


@pytest.mark.parametrize("page", list(IN_PROCESS))
def test_the_page_s_command_trains_as_written(page, ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    from posttrain.config import load_config
    from posttrain.run.context import run_algorithm
    from tests.docs.commands import parse_posttrain

    command = next(line for b in blocks(page) if b.language == "bash" for line in command_lines(b.text)
                   if line[:2] == ["posttrain", "run"])
    parsed = parse_posttrain(command[1:])
    monkeypatch.chdir(REPO)  # the pages' paths are the repository's
    shorter = [o.format(out=tmp_path) for o in IN_PROCESS[page]]
    config = load_config(parsed.config, [*parsed.overrides, f"algorithm={parsed.algorithm}", f"policy.model={tiny_model_path}",
                                         f"run_dir={tmp_path / 'run'}", "logger.progress_bar=false", *shorter])
    run_algorithm(config)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")] == [1, 2]


def test_the_eval_page_s_command_evaluates_as_written(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    """``posttrain eval MODEL --data ... -n 8 -k 1,4,8``, the page's first command, on the tiny
    model: every k's pass@k and maj@k are reported."""
    from posttrain.cli import main

    command = next(line for b in blocks("algorithms/eval.md") if b.language == "bash" for line in command_lines(b.text)
                   if line[:2] == ["posttrain", "eval"])
    assert command[2] == "runs/tiny_model", command
    monkeypatch.chdir(REPO)  # the page's data path is the repository's
    assert main([*command[1:2], tiny_model_path, *command[3:], "--run-dir", str(tmp_path / "eval")]) == 0
    (metrics,) = read_metrics(tmp_path / "eval" / "metrics.jsonl", "validation")
    assert {f"{kind}_at_{k}" for kind in ("pass", "maj") for k in (1, 4, 8)} <= set(metrics), metrics
    assert ray_cluster.is_initialized()  # the session's cluster is left running
