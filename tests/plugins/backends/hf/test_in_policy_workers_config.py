"""``generation.in_policy_workers`` refused where it cannot work, when the config is loaded
(no Ray), and by a run that has no policy: each message names the keys and the fix."""

from __future__ import annotations

import textwrap

import pytest

from posttrain.config import load_config
from posttrain.config.features import declared_features
from posttrain.errors import ConfigError
from posttrain.run.context import RunContext
from posttrain_hf.config import HFGenerationConfig


def refusal(tmp_path, model: str, generation: str, policy: str = "") -> str:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run_dir: {tmp_path / 'run'}\npolicy:\n  model: {model}\n{textwrap.indent(policy, '  ')}"
        f"generation:\n  in_policy_workers: true\n{textwrap.indent(textwrap.dedent(generation), '  ')}"
    )
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    return str(error.value)


REFUSALS = {
    "a backend with engines of its own": (
        "backend: vllm\n", "",
        "generation.in_policy_workers is true, but the generation backend 'vllm' (posttrain-vllm 0.1.0) runs its engines "
        "in processes of their own; backends that run in the policy's workers: hf. Set generation.backend to one of "
        "them, or generation.in_policy_workers: false. Where set: generation.in_policy_workers at {file}:5; "
        "generation.backend at {file}:6.",
    ),
    "engines beside the policy": (
        "colocated: false\n", "",
        "generation.in_policy_workers is true with generation.colocated false: engines inside the policy's processes "
        "take turns with training, they cannot run beside it. Set generation.colocated: true, or "
        "generation.in_policy_workers: false. Where set: generation.in_policy_workers at {file}:5; "
        "generation.colocated at {file}:6.",
    ),
    "an engine count other than the policy's": (
        "num_workers: 3\n", "num_workers: 2\ntrain_global_batch_size: 2\ntrain_micro_batch_size: 1\n",
        "generation.num_workers is 3, but with generation.in_policy_workers the engines are the policy's 2 worker(s), "
        "one each; leave generation.num_workers at 1 or set it to 2. Where set: generation.num_workers at {file}:9; "
        "policy.num_workers at {file}:4.",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_settings_it_cannot_work_with_are_refused(tmp_path, tiny_model_path, case):
    generation, policy, expected = REFUSALS[case]
    message = refusal(tmp_path, tiny_model_path, generation, policy)
    assert message == expected.format(file=tmp_path / "run.yaml"), message


def test_a_run_without_a_policy_refuses_it(tmp_path, tiny_model_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\npolicy:\n  model: {tiny_model_path}\n"
                    "generation:\n  in_policy_workers: true\n")
    context = RunContext(load_config(str(path)))
    with pytest.raises(ConfigError) as error:
        context.build_generation()
    assert str(error.value).startswith(
        "generation.in_policy_workers is true, but this run's generation engines have no policy to run in "
        "(algorithm None trains none); set generation.in_policy_workers: false"
    ), str(error.value)


def test_the_hf_section_declares_the_feature():
    assert "engines inside the policy's workers (generation.in_policy_workers)" in declared_features(HFGenerationConfig)


DEFAULTS = {  # settings over the tiny model's config -> whether the engines go inside the policy's workers
    "hf, colocated, on CPUs": ({}, True),
    "vllm": ({"generation": {"backend": "vllm"}}, False),
    "engines beside the policy": ({"generation": {"colocated": False}}, False),
    "engines asking for GPUs": ({"generation": {"resources": {"gpus": 1}}, "cluster": {"use_gpus": True}}, False),
    "a policy asking for GPUs": ({"policy": {"resources": {"gpus": 1}}, "cluster": {"use_gpus": True}}, False),
    "fewer engines than policy workers": ({"policy": {"num_workers": 2}}, False),
    "as many engines as policy workers": ({"policy": {"num_workers": 2}, "generation": {"num_workers": 2}}, True),
    "another model for the engines": ({"generation": {"model": "elsewhere"}}, False),
}


@pytest.mark.parametrize("case", list(DEFAULTS))
def test_left_null_the_engines_go_inside_the_policys_workers_only_where_they_can(tiny_model_path, case):
    from posttrain.config import config_from_dict
    from posttrain.config.validate import in_policy_workers_by_default
    from posttrain.plugins import plugin_host

    settings, expected = DEFAULTS[case]
    tree = {"policy": {"model": tiny_model_path, "train_global_batch_size": 4, "train_micro_batch_size": 2},
            "generation": {}}
    for section, values in settings.items():
        tree.setdefault(section, {}).update(values)
    config = config_from_dict(tree)
    assert config.generation.in_policy_workers is None
    assert in_policy_workers_by_default(config, plugin_host()) is expected
