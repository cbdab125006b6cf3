"""``posttrain run`` and Ray: it stops the Ray it started, never one it found running."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.plugins import plugin_host

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_a_run_leaves_a_ray_it_did_not_start_running(ray_cluster, tiny_model_path, tmp_path, monkeypatch, capsys):
    model = Path(shutil.copytree(tiny_model_path, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))  # refused by the model check
    monkeypatch.chdir(REPO)
    code = cli.main(["run", "sft", "--config", "examples/configs/sft.yaml", f"policy.model={model}", f"run_dir={tmp_path / 'run'}"])
    assert code == 2 and "has 103 tokens" in capsys.readouterr().err
    assert ray_cluster.is_initialized()


# ----------------------------------------------------------------------------- config show


def _commented_keys(output: str) -> dict[str, str]:
    """``{dotted key: its comment}`` of ``posttrain config show``'s lines (two spaces of
    indent per level)."""
    out, stack = {}, []
    for line in output.splitlines():
        text, _, comment = line.partition("  # ")
        depth = (len(text) - len(text.lstrip())) // 2
        stack[depth:] = [text.strip().split(":", 1)[0]]
        out[".".join(stack)] = comment
    return out


def test_config_show_writes_every_key_of_the_run_with_its_value_and_doc(monkeypatch, capsys):
    import yaml

    from posttrain.config import load_config
    from posttrain.config.loader import dump_config
    from posttrain.config.reference import config_sections

    monkeypatch.chdir(REPO)
    args = ["--config", "examples/configs/grpo_math_tiny.yaml", "policy.optimizer.lr=1e-3", "generation.backend=vllm"]
    assert cli.main(["config", "show", "grpo", *args]) == 0
    output = capsys.readouterr().out

    # the values: the resolved config, less the sections a GRPO run with these backends does not read
    expected = yaml.safe_load(dump_config(load_config(args[1], [*args[2:], "algorithm=grpo"])))
    other_algorithms = tuple(name for name in plugin_host().algorithms if name != "grpo" and name in expected)
    assert {"dpo", "sft"} <= set(other_algorithms)
    for unread in other_algorithms:
        del expected[unread]
    del expected["policy"]["megatron"], expected["generation"]["hf"], expected["data_plane"]["transferqueue"]
    shown = yaml.safe_load(output)
    assert shown == expected
    assert shown["policy"]["optimizer"]["lr"] == 1e-3 and shown["generation"]["vllm"]["enable_sleep_mode"] is True

    # the documentation: every shown key's comment is its reference doc, then where it was set
    comments = _commented_keys(output)
    sections = {section.path: section for section in config_sections()}
    keys = [key for path in sections for key in sections[path].keys]
    unread = (*other_algorithms, "policy.megatron", "generation.hf", "data_plane.transferqueue")
    as_paths = ("data.train.", "data.validation.")  # keys of the mapping form; these are paths here
    missing = [key.path for key in keys if key.path not in comments]
    assert [path for path in missing if not path.startswith(unread + as_paths)] == []
    assert len(keys) - len(missing) > 150
    for key in keys:
        if key.path in comments:
            assert comments[key.path].startswith(key.doc), key.path
    assert comments["policy.optimizer.lr"] == (
        "base learning rate (>= 0), scaled per optimizer step by policy.scheduler "
        "(set at command line override 'policy.optimizer.lr=1e-3')"
    )
    assert comments["policy.model"] == "a local Hugging Face folder (set at examples/configs/grpo_math_tiny.yaml:22)"
    assert comments["policy.optimizer.eps"] == "added to Adam's denominator (>= 0); unused by sgd"
    assert re.search(r"^  optimizer: +# the optimizer \(set at [^\n]*\n    name: adamw +# [^\n]*\n    lr: 0\.001 +# base", output,
                     re.MULTILINE)


def test_config_show_refuses_an_unknown_algorithm_as_run_does(capsys):
    assert cli.main(["config", "show", "sftt"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: unknown algorithm 'sftt'; installed: ") and error.endswith("Did you mean 'sft'?\n")


def test_the_command_collects_garbage_less_often(monkeypatch):
    import gc

    from posttrain.gc_thresholds import THRESHOLDS

    monkeypatch.setattr(gc, "set_threshold", lambda *thresholds: seen.append(thresholds))
    seen: list[tuple[int, ...]] = []
    cli.main(["config", "show", "sftt"])
    assert seen == [THRESHOLDS]


def test_sigterm_outside_a_run_s_steps_exits_143_saying_so(monkeypatch, capsys):
    """While a command starts up or shuts down (no run's stop handling installed), SIGTERM
    stops it at once with 128 + 15, as Slurm and Kubernetes expect, not as a Ctrl-C."""
    import os
    import signal
    import time
    from types import SimpleNamespace

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
        return 0

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "parse_arguments", lambda parser, argv: SimpleNamespace(func=terminated))
    try:
        assert cli.main(["config", "show", "sft"]) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err == "terminated by SIGTERM\n"
