"""``policy.lora`` refused when the config is loaded (no worker, no Ray): each message names the
key, what was expected, what was found, where it was set and the fix."""

from __future__ import annotations

import re
import textwrap

import pytest

from posttrain.config import load_config
from posttrain.errors import ConfigError


def config_file(tmp_path, model: str, lora: str, backend: str = "dtensor"):
    path = tmp_path / "run.yaml"
    body = textwrap.indent(textwrap.dedent(lora).strip("\n"), "    ")
    path.write_text(f"policy:\n  backend: {backend}\n  model: {model}\n  lora:\n    enabled: true\n{body}\n")
    return str(path)


def refusal(tmp_path, model: str, lora: str, backend: str = "dtensor") -> str:
    with pytest.raises(ConfigError) as error:
        load_config(config_file(tmp_path, model, lora, backend))
    return str(error.value)


def test_a_target_that_matches_nothing_lists_the_layers_there_are(tmp_path, tiny_model_path):
    message = refusal(tmp_path, tiny_model_path, "target_modules: [qproj, vproj]")
    assert message.startswith(f"policy.lora.target_modules: ['qproj', 'vproj'] matches no module of the model "
                              f"'{tiny_model_path}'. Its linear layers (the output head aside) are named down_proj, "
                              "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (a list entry"), message
    assert message.endswith("Where set: policy.lora.target_modules at " + f"{tmp_path / 'run.yaml'}:6."), message


def test_a_regular_expression_that_matches_nothing_is_refused(tmp_path, tiny_model_path):
    message = refusal(tmp_path, tiny_model_path, r"target_modules: '.*\.attn\.q'")
    assert "matches no module" in message and "such as 'model.layers.0.self_attn.q_proj'" in message, message


def test_the_output_head_is_refused(tmp_path, tiny_model_path):
    message = refusal(tmp_path, tiny_model_path, "target_modules: [q_proj, lm_head]")
    assert message.startswith("policy.lora.target_modules: ['q_proj', 'lm_head'] puts an adapter on the output head "
                              "'lm_head'"), message


@pytest.mark.parametrize(("line", "expected"), [
    ("rank: 0", "policy.lora.rank: expected an integer >= 1, e.g. 8, found 0."),
    ("rank: -4", "policy.lora.rank: expected an integer >= 1, e.g. 8, found -4."),
    ("alpha: 0", "policy.lora.alpha: expected a number > 0, e.g. 16 (the adapters' scale is alpha / rank), found 0.0."),
    ("dropout: 1.0", "policy.lora.dropout: expected a probability in [0, 1), e.g. 0.05, found 1.0."),
    ("target_modules: []", "policy.lora.target_modules: expected module names (e.g. [q_proj, v_proj]), a regular "
                           "expression, or all-linear, found []."),
])
def test_bad_values_name_the_key_and_where_it_was_set(tmp_path, tiny_model_path, line, expected):
    message = refusal(tmp_path, tiny_model_path, line)
    key = expected.split(":", 1)[0]
    assert message == f"{expected} Where set: {key} at {tmp_path / 'run.yaml'}:6.", message


def test_a_backend_without_lora_is_refused_naming_those_with_it(tmp_path, tiny_model_path):
    message = refusal(tmp_path, tiny_model_path, "rank: 8", backend="megatron")
    assert re.fullmatch(
        r"policy\.lora\.enabled is true, but the policy backend 'megatron' \(posttrain-megatron [\d.]+\) does not "
        r"implement LoRA; policy backends that do: dtensor\. Set policy\.backend to one of them, or "
        r"policy\.lora\.enabled: false\. Where set: policy\.lora\.enabled at .*run\.yaml:5; policy\.backend at "
        r".*run\.yaml:2\.", message), message


def test_lora_off_is_not_checked(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  backend: megatron\n  lora:\n    rank: 0\n")
    assert load_config(str(path)).policy.lora.rank == 0


def test_an_adapter_refit_needs_a_generation_backend_that_loads_adapters(tmp_path, tiny_model_path):
    path = config_file(tmp_path, tiny_model_path, "refit: adapter")
    with open(path, "a") as stream:
        stream.write("generation:\n  backend: hf\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert re.fullmatch(
        r"policy\.lora\.refit is adapter, but the generation backend 'hf' \(posttrain-hf [\d.]+\) does not load LoRA "
        r"adapters; generation backends that do: vllm\. Set generation\.backend to one of them, or policy\.lora\.refit: "
        r"merged \(every backend loads merged weights\)\. Where set: policy\.lora\.refit at .*run\.yaml:6; "
        r"generation\.backend at .*run\.yaml:8\.", str(error.value)), str(error.value)


def test_posttrain_plugins_lists_the_backends_with_lora():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "posttrain.cli", "plugins"], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    dtensor = lines.index("  policy backend: dtensor")
    assert lines[dtensor + 1] == "  config section: policy.dtensor"
    assert lines[dtensor + 2].startswith("  features: LoRA (policy.lora), ")
    megatron = lines.index("  policy backend: megatron")
    assert lines[megatron + 2].startswith("  features: ") and "LoRA" not in lines[megatron + 2], lines[megatron + 2]
    vllm = lines.index("  generation backend: vllm")
    assert lines[vllm + 2].startswith("  features: LoRA adapters sent by refit (policy.lora.refit: adapter), ")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_all_linear_on_a_mixture_of_experts_adapts_its_linear_layers(tmp_path, zoo_model, arch):
    """The experts are packed 3-D parameters, not linear layers: all-linear leaves them (and the
    router, which is not a linear layer either) frozen; naming them is refused listing the
    model's own linear layers, not peft's (``base_layer``, ``default``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.config.schema import LoraConfig, PolicyConfig, RunConfig
    from posttrain_dtensor.lora import attach_adapters

    load_config(config_file(tmp_path, zoo_model(arch), "target_modules: all-linear"))
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(zoo_model(arch)))
    config = RunConfig(policy=PolicyConfig(model=zoo_model(arch), lora=LoraConfig(enabled=True)))
    adapted = attach_adapters(lm, config)
    assert sorted({path.rsplit(".", 1)[1] for path in adapted}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert len(adapted) == 8  # four projections in each of two layers
    message = refusal(tmp_path, zoo_model(arch), "target_modules: [experts]")
    assert message.startswith(f"policy.lora.target_modules: ['experts'] matches 'model.layers.0.mlp.experts', a "
                              f"{type(lm.model.layers[0].mlp.experts).__name__}; the dtensor backend adapts linear "
                              "layers only: k_proj, o_proj, q_proj, v_proj. Where set:"), message
