"""``policy.in_driver``: decided by the run where the policy can run in the driver's process,
refused where it cannot, each refusal naming the keys and the fix."""

from __future__ import annotations

import textwrap

import pytest

from posttrain.config import load_config
from posttrain.config.validate import policy_in_driver_by_default
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host


def load(tmp_path, model: str, policy: str = "", rest: str = ""):
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\npolicy:\n  model: {model}\n{textwrap.indent(policy, '  ')}{rest}")
    return load_config(str(path))


def test_left_null_it_is_chosen_for_one_cpu_worker_on_a_cluster_of_the_run_s_own(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cases = {
        "defaults": ("", "", True),
        "two workers": ("num_workers: 2\ntrain_global_batch_size: 2\ntrain_micro_batch_size: 1\n", "", False),
        "megatron": ("backend: megatron\n", "", False),
        "a pip environment": ("resources:\n  runtime_env:\n    pip: [x]\n", "", False),
        "environment variables": ("resources:\n  env_vars:\n    A: b\n", "", True),
        "a joined cluster": ("", "cluster:\n  ray_address: 10.0.0.1:6379\n", False),
    }
    chosen = {name: policy_in_driver_by_default(load(tmp_path, tiny_model_path, policy, rest), plugin_host())
              for name, (policy, rest, _) in cases.items()}
    assert chosen == {name: expected for name, (*_, expected) in cases.items()}
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not policy_in_driver_by_default(load(tmp_path, tiny_model_path), plugin_host())


REFUSALS = {
    "a backend that cannot": (
        "backend: megatron\n", "",
        "policy.in_driver is true, but the policy backend 'megatron' (posttrain-megatron 0.1.0) cannot run its worker "
        "there; backends that can: dtensor. Set policy.in_driver: false (or null: decided by the run). Where set: "
        "policy.in_driver at {file}:4; policy.backend at {file}:5.",
    ),
    "two workers": (
        "num_workers: 2\ntrain_global_batch_size: 2\ntrain_micro_batch_size: 1\n", "",
        "policy.in_driver is true, but policy.num_workers is 2; the driver holds one worker. Set policy.in_driver: "
        "false (or null: decided by the run). Where set: policy.in_driver at {file}:4; policy.num_workers at {file}:5.",
    ),
    "a joined cluster": (
        "", "cluster:\n  ray_address: 10.0.0.1:6379\n",
        "policy.in_driver is true, but the run joins a cluster; the policy runs on its nodes. Set policy.in_driver: "
        "false (or null: decided by the run). Where set: policy.in_driver at {file}:4; cluster.ray_address at {file}:6.",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_settings_it_cannot_work_with_are_refused(tmp_path, tiny_model_path, case):
    policy, rest, expected = REFUSALS[case]
    with pytest.raises(ConfigError) as raised:
        load(tmp_path, tiny_model_path, "in_driver: true\n" + policy, rest)
    assert str(raised.value) == expected.format(file=tmp_path / "run.yaml")
