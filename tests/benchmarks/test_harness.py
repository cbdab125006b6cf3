"""The benchmark harness (benchmarks/common.py) cannot rot silently: its FLOP counter
matches a hand count and the model's own linear layers, its settings check names every
difference, and the SFT workload's posttrain and TRL sides, run as the benchmark runs
them (own subprocesses, tiny model, two steps), train the same thing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402


def tiny_config():
    from posttrain.models.tiny import SIZES, build_tokenizer, tiny_llama_config

    return tiny_llama_config(len(build_tokenizer()), **SIZES["tiny"])


def test_matmul_parameters_are_the_linear_weights_of_the_model():
    from transformers import LlamaForCausalLM

    config = tiny_config()
    model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert common.matmul_parameters(config) == linear


def test_forward_flops_equal_the_hand_count():
    config = tiny_config()  # hidden 64, 2 layers, 2 heads of 32, 2 kv heads, intermediate 128
    per_layer = 64 * (64 + 2 * 64) + 64 * 64 + 3 * 64 * 128
    params = 2 * per_layer + config.vocab_size * 64
    attention = 2 * 2 * 64 * (3 * 3 + 5 * 5)
    assert common.forward_flops(config, [3, 5]) == 2 * params * 8 + attention


def result(lr=1e-5, digest="abc", loss=4.0, loss_tokens=10):
    return {"settings": {"lr": lr, "optimizer": "adamw"}, "losses": [loss],
            "steps": [{"digest": digest, "lengths": [3, 5], "loss_tokens": loss_tokens}]}


def test_settings_check_names_every_difference():
    common.check_settings({"a": result(), "b": result()})
    with pytest.raises(common.SettingsMismatch) as err:
        common.check_settings({"a": result(), "b": result(lr=2e-5, digest="abd", loss=4.01, loss_tokens=9)})
    assert str(err.value).splitlines()[1:] == [
        "  setting 'lr': a=1e-05 but b=2e-05",
        "  step 1 digest: a='abc' but b='abd'",
        "  step 1 loss_tokens: a=10 but b=9",
        "  first-step loss: a=4.000000 but b=4.010000 (rtol 0.0001)",
    ]


def test_padding_free_rows_split_where_positions_restart():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert common.rows_of(ids, position_ids=torch.tensor([[0, 1, 0, 1, 2]])) == [[5, 6], [7, 8, 9]]
    assert common.rows_of(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]])) == [[5, 6]]


@pytest.mark.trl
@pytest.mark.ray
def test_sft_sides_train_the_same_weights_on_the_same_samples(tmp_path):
    pytest.importorskip("trl")
    import sft

    args = common.parse_args(sft.WORKLOAD, ["--model", "tiny", "--steps", "1", "--max-len", "32"])
    spec = common.make_spec(sft.WORKLOAD, args, tmp_path)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(common.json.dumps(spec))
    runs = {side: common.run_child(sft.WORKLOAD.script, side, spec_path, timeout_s=300)
            for side in ("posttrain-packed", "trl-best")}
    common.check_settings(runs)
    for run in runs.values():
        assert len(run["step_times_s"]) == 1 and run["step_times_s"][0] > 0
        assert run["peak_rss_mb"] > 100  # a Python process with torch loaded
    assert runs["posttrain-packed"]["losses"][1] == pytest.approx(runs["trl-best"]["losses"][1], rel=1e-3)


def test_processes_are_told_apart_by_what_they_run():
    from common import process_role

    assert process_role("anything", root=True) == "driver"
    assert process_role("ray::DTensorPolicyWorker.train_from") == "ray::DTensorPolicyWorker"
    assert process_role("ray::IDLE") == "ray idle worker"
    assert process_role("/venv/bin/python -m posttrain.deadline_pool 7 mod:fn 12") == (
        "python -m posttrain.deadline_pool")
    assert process_role("/venv/lib/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp") == "gcs_server"
    assert process_role("/venv/bin/python /venv/lib/ray/dashboard/agent.py --node-ip") == "agent.py"
    assert process_role("/venv/bin/python -u /venv/lib/ray/_private/log_monitor.py --x=1") == "log_monitor.py"
    assert process_role("/venv/bin/python -c from multiprocessing import x") == "python -c"
    assert process_role("") == "other"


def test_ray_infrastructure_is_counted_apart_from_the_training():
    from common import is_ray_infrastructure

    for ray_own in ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
                    "/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp",
                    "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x",
                    "/venv/bin/python -u /venv/lib/python3.11/site-packages/ray/_private/log_monitor.py",
                    "/venv/bin/python /venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py --host=x"):
        assert is_ray_infrastructure(ray_own), ray_own
    for training in ("ray::DTensorPolicyWorker.train", "ray::VllmEngineWorker", "ray::EnvironmentActor.step",
                     "/venv/bin/python -c from multiprocessing.spawn import spawn_main",
                     "/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet", "/venv/bin/python -m posttrain.deadline_pool"):
        assert not is_ray_infrastructure(training), training
    assert not is_ray_infrastructure("")  # a process whose command line could not be read
