"""The PPO and distillation pages' configs and commands, as written, on the default local
cluster of a 2-core machine (``cluster.num_cpus=2`` on any machine): ``posttrain run ppo
--config ppo.yaml`` (policy, critic, engine, math) and ``posttrain run distill --config
distill.yaml`` (student, teacher, engine, math) place every worker group and train, with
only the model folder and the run's length changed. With
engines and environments in processes of their own, the groups asked for one CPU more than
the two the machine has and the run waited 120 s to be refused."""

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
