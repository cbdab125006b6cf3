"""The YAML config loader: inheritance, overrides, interpolation, structuring, validation."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Literal

import attrs
import pytest

import posttrain
from posttrain.config import (
    OptimizerConfig,
    RunConfig,
    config_from_dict,
    dump_config,
    load_config,
    require_registered,
)
from posttrain.errors import ConfigError
from posttrain.plugins import PluginHost, new_plugin_host


@attrs.define
class ToyConfig:
    num_generations: int = 4
    temperature: float = 1.0
    tags: list[str] = attrs.field(factory=list)
    weights: dict[str, float] = attrs.field(factory=dict)
    cap: int | None = None
    mode: Literal["mean", "leave_one_out"] = "mean"
    level: Literal[1, 2] | None = None


@attrs.define
class ToyBackendConfig:
    shards: int = 1

    def replica_factors(self) -> list[tuple[str, int]]:
        return [("policy.toy_backend.shards", self.shards)]


@attrs.define
class NeedsValueConfig:
    required_count: int


class ToyPlugin:
    """Registers a data plane, environments that declare no options, three config sections
    and a validation rule."""

    @posttrain.hookimpl
    def posttrain_data_planes(self):
        return {"memory": lambda config: None}

    @posttrain.hookimpl
    def posttrain_environments(self):
        return {name: lambda options: None for name in ("math", "base", "child", "again")}

    @posttrain.hookimpl
    def posttrain_config_sections(self):
        return {"toy": ToyConfig, "policy.toy_backend": ToyBackendConfig, "needs": NeedsValueConfig}

    @posttrain.hookimpl
    def posttrain_validate_config(self, config):
        toy = config.section("toy")
        if toy.num_generations > 16:
            raise ConfigError(f"toy.num_generations={toy.num_generations} is above the limit of 16")


@pytest.fixture
def host() -> PluginHost:
    fresh = new_plugin_host(load_entry_points=False)
    fresh.register(ToyPlugin(), name="toy-plugin")
    return fresh


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in tmp_path so files are shown by their relative names ("exp.yaml:7")."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    """Write dedented YAML; line 1 is the first line of ``text`` after the opening newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


# --------------------------------------------------------------------------- inheritance


def test_inheritance_two_levels_merges_mappings_and_replaces_lists(in_tmp, host):
    write(
        in_tmp / "common/base.yaml",
        """
        seed: 1
        policy:
          model: /models/base
          optimizer:
            lr: 0.1
            weight_decay: 0.01
            betas: [0.5, 0.6]
        generation:
          stop_strings: [a, b, c]
          temperature: 0.7
        """,
    )
    write(
        in_tmp / "common/mid.yaml",
        """
        defaults: base.yaml
        policy:
          optimizer:
            lr: 0.2
        generation:
          stop_strings: [x]
        """,
    )
    write(
        in_tmp / "exp/run.yaml",
        """
        defaults: [../common/mid.yaml]
        seed: 3
        policy:
          optimizer:
            betas: [0.8, 0.9]
        """,
    )
    config = load_config("exp/run.yaml", host=host)

    assert config.seed == 3
    assert config.policy.model == "/models/base"
    assert config.policy.optimizer == OptimizerConfig(lr=0.2, weight_decay=0.01, betas=[0.8, 0.9])
    assert config.generation.stop_strings == ["x"]  # replaced, not appended
    assert config.generation.temperature == 0.7
    assert config.sources["policy.optimizer.weight_decay"] == "common/base.yaml:6"
    assert config.sources["policy.optimizer.lr"] == "common/mid.yaml:4"
    assert config.sources["policy.optimizer.betas"] == "exp/run.yaml:5"
    assert config.sources["generation.stop_strings"] == "common/mid.yaml:6"
    assert "defaults" not in config.raw


def test_later_defaults_entry_wins(in_tmp, host):
    write(in_tmp / "a.yaml", "seed: 1\nrun_dir: from_a\n")
    write(in_tmp / "b.yaml", "seed: 2\n")
    write(in_tmp / "exp.yaml", "defaults: [a.yaml, b.yaml]\n")
    config = load_config(in_tmp / "exp.yaml", host=host)
    assert (config.seed, config.run_dir) == (2, "from_a")


def test_defaults_cycle_is_named(in_tmp, host):
    write(in_tmp / "a.yaml", "defaults: b.yaml\n")
    write(in_tmp / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError) as err:
        load_config("a.yaml", host=host)
    assert "config files inherit from each other in a cycle: a.yaml -> b.yaml -> a.yaml" in str(err.value)


def test_missing_defaults_file_names_where_it_was_named(in_tmp, host):
    write(in_tmp / "exp.yaml", "seed: 1\ndefaults: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"config file 'nope.yaml' not found \(named in 'defaults' at exp.yaml:2\)"):
        load_config("exp.yaml", host=host)


# --------------------------------------------------------------------------- overrides, interpolation


def test_overrides_nested_lists_null_and_new_keys(in_tmp, host):
    write(
        in_tmp / "exp.yaml",
        """
        policy:
          max_grad_norm: 0.5
          optimizer: {lr: 0.1}
        """,
    )
    config = load_config(
        "exp.yaml",
        [
            "policy.optimizer.lr=1e-5",
            "generation.stop_strings=[a, 'b c']",
            "policy.max_grad_norm=null",
            "environments.math.options={k: 3}",
            "data.train=",
        ],
        host=host,
    )
    assert config.policy.optimizer.lr == 1e-5 and isinstance(config.policy.optimizer.lr, float)
    assert config.generation.stop_strings == ["a", "b c"]
    assert config.policy.max_grad_norm is None
    assert config.environments == {"math": {"options": {"k": 3}}}
    assert config.data.train == ""
    assert config.sources["policy.optimizer.lr"] == "command line override 'policy.optimizer.lr=1e-5'"
    assert config.sources["environments.math.options.k"] == "command line override 'environments.math.options={k: 3}'"


def test_override_through_a_scalar_is_refused(host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"seed": 5}, ["seed.x=1"], host=host)
    assert "cannot set 'seed.x' because 'seed' (at <dict>) holds int 5, not a mapping" in str(err.value)


@pytest.mark.parametrize("text", ["policy.optimizer.lr", "=3", "policy..lr=3"])
def test_malformed_override(text, host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, [text], host=host)
    assert f"malformed override '{text}': expected the form key.path=value" in str(err.value)


def test_interpolation_follows_overrides_and_env(in_tmp, host, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_RUNS", "/scratch/runs")
    write(
        in_tmp / "exp.yaml",
        """
        policy:
          model: /models/a
        generation:
          model: ${policy.model}
        run_dir: ${oc.env:POSTTRAIN_TEST_RUNS,runs}/${policy.model}
        data:
          train: ${oc.env:POSTTRAIN_TEST_UNSET_VAR,default.jsonl}
        """,
    )
    config = load_config("exp.yaml", ["policy.model=/models/b"], host=host)
    assert config.generation.model == "/models/b"
    assert config.run_dir == "/scratch/runs//models/b"
    assert config.data.train == "default.jsonl"
    assert config.raw["generation"]["model"] == "/models/b"


def test_unresolvable_interpolation_names_key_and_line(in_tmp, host):
    write(in_tmp / "exp.yaml", "seed: 1\ngeneration:\n  model: ${policy.nope}\n")
    with pytest.raises(ConfigError) as err:
        load_config("exp.yaml", host=host)
    assert "config key 'generation.model' (at exp.yaml:3): Interpolation key 'policy.nope' not found" in str(err.value)


# --------------------------------------------------------------------------- structuring errors


def test_unknown_and_mistyped_keys_name_file_and_line(in_tmp, host):
    lines = """
        seed: 7
        run_dir: runs/x
        policy:
          model: /m
          dtype: float32
          num_workers: 1
          optimzer:
            lr: 0.1
        """
    write(in_tmp / "exp.yaml", lines)
    with pytest.raises(ConfigError) as err:
        load_config("exp.yaml", host=host)
    assert "unknown config key 'policy.optimzer' (at exp.yaml:7). Did you mean 'policy.optimizer'?" in str(err.value)

    write(
        in_tmp / "exp.yaml",
        """
        seed: 7
        run_dir: runs/x
        policy:
          model: /m
          dtype: float32
          num_workers: 1
          scheduler:
            name: constant
          max_grad_norm: 1.0
          tensor_parallel_size: 1
          optimizer:
            lr: abc
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_config("exp.yaml", host=host)
    assert "config key 'policy.optimizer.lr' (at exp.yaml:12): expected float, found str 'abc'" in str(err.value)


def test_unknown_key_without_close_match_lists_valid_keys(host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"checkpointing": {"zzz": 1}}, host=host)
    message = str(err.value)
    assert "unknown config key 'checkpointing.zzz' (at <dict>). Valid keys here: dir, enabled," in message
    assert "Did you mean" not in message


def test_scalar_type_rules(host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"policy": {"num_workers": True}}, host=host)
    assert "config key 'policy.num_workers' (at <dict>): expected int, found bool True" in str(err.value)

    with pytest.raises(ConfigError) as err:
        config_from_dict({"policy": {"optimizer": {"lr": False}}}, host=host)
    assert "config key 'policy.optimizer.lr' (at <dict>): expected float, found bool False" in str(err.value)

    with pytest.raises(ConfigError) as err:  # strings are not turned into numbers
        config_from_dict({"policy": {"max_grad_norm": "1.5"}}, host=host)
    assert "config key 'policy.max_grad_norm' (at <dict>): expected float or null, found str '1.5'" in str(err.value)

    with pytest.raises(ConfigError) as err:
        config_from_dict({"generation": {"stop_token_ids": [1, "2"]}}, host=host)
    assert "config key 'generation.stop_token_ids[1]' (at <dict>): expected int, found str '2'" in str(err.value)

    config = config_from_dict({"policy": {"optimizer": {"lr": 1, "betas": [0, 0.5]}}}, host=host)
    assert type(config.policy.optimizer.lr) is float and config.policy.optimizer.lr == 1.0
    assert [type(b) for b in config.policy.optimizer.betas] == [float, float]


def test_literal_fields(host):
    config = config_from_dict({"toy": {"mode": "leave_one_out", "level": 2}}, host=host)
    assert (config.section("toy").mode, config.section("toy").level) == ("leave_one_out", 2)

    with pytest.raises(ConfigError) as err:
        config_from_dict({"toy": {"mode": "leave_one_ot"}}, host=host)
    assert (
        "config key 'toy.mode' (at <dict>): expected one of 'mean', 'leave_one_out', found str 'leave_one_ot'. "
        "Did you mean 'leave_one_out'?"
    ) in str(err.value)

    with pytest.raises(ConfigError) as err:  # True == 1 in Python, but not here
        config_from_dict({"toy": {"level": True}}, host=host)
    assert "config key 'toy.level' (at <dict>): expected one of 1, 2 or null, found bool True" in str(err.value)


def test_yaml_scalars_are_yaml_1_2(in_tmp, host):
    write(
        in_tmp / "exp.yaml",
        """
        generation:
          stop_strings: [no, on, 2024-01-01, '012', 1:30]
          temperature: 5e-1
        logger:
        """,
    )
    config = load_config("exp.yaml", host=host)
    assert config.generation.stop_strings == ["no", "on", "2024-01-01", "012", "1:30"]
    assert config.generation.temperature == 0.5
    assert config.logger == RunConfig().logger  # an empty section takes its defaults


def test_duplicate_yaml_key_is_refused(in_tmp, host):
    write(in_tmp / "exp.yaml", "seed: 1\nrun_dir: a\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"exp.yaml:3: duplicate key 'seed' \(first at line 1\)"):
        load_config("exp.yaml", host=host)


def test_anchors_and_merge_keys_are_not_duplicates(in_tmp, host):
    write(
        in_tmp / "exp.yaml",
        """
        environments:
          base: &base {limit: 1, mode: a}
          child: &child
            <<: *base
            limit: 2
          again: *child
        """,
    )
    config = load_config("exp.yaml", host=host)
    assert config.environments["again"] == {"limit": 2, "mode": "a"}
    assert config.sources["environments.child.limit"] == "exp.yaml:5"


def test_loader_owned_fields_cannot_be_set_from_yaml(host):
    with pytest.raises(ConfigError, match=r"unknown config key 'raw' \(at <dict>\)"):
        config_from_dict({"raw": {}}, host=host)


# --------------------------------------------------------------------------- plugin sections


def test_plugin_sections_structured_from_yaml(in_tmp, host):
    write(
        in_tmp / "exp.yaml",
        """
        toy:
          num_generations: 8
          temperature: 2
          tags: [a, b]
          weights: {x: 1, y: 0.5}
        policy:
          toy_backend:
            shards: 3
        """,
    )
    config = load_config("exp.yaml", host=host)
    assert config.section("toy") == ToyConfig(
        num_generations=8, temperature=2.0, tags=["a", "b"], weights={"x": 1.0, "y": 0.5}
    )
    assert type(config.section("toy").temperature) is float
    assert config.section("policy.toy_backend") == ToyBackendConfig(shards=3)
    assert "needs" not in config.sections  # required field and absent: no default instance


def test_absent_plugin_sections_get_defaults(host):
    config = config_from_dict({}, host=host)
    assert config.section("toy") == ToyConfig()
    assert config.section("policy.toy_backend") == ToyBackendConfig()


def test_unknown_keys_near_plugin_sections(in_tmp, host):
    write(in_tmp / "exp.yaml", "toy:\n  num_generatons: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config("exp.yaml", host=host)
    assert "unknown config key 'toy.num_generatons' (at exp.yaml:2). Did you mean 'toy.num_generations'?" in str(
        err.value
    )

    with pytest.raises(ConfigError) as err:
        config_from_dict({"policy": {"toy_backnd": {"shards": 2}}}, host=host)
    assert "unknown config key 'policy.toy_backnd' (at <dict>). Did you mean 'policy.toy_backend'?" in str(err.value)

    with pytest.raises(ConfigError) as err:
        config_from_dict({"tyo": {}}, host=host)
    assert "unknown config key 'tyo' (at <dict>). Did you mean 'toy'?" in str(err.value)


def test_missing_required_key(host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"needs": {}}, host=host)
    assert "missing config key 'needs.required_count' (expected int)" in str(err.value)
    assert config_from_dict({"needs": {"required_count": 2}}, host=host).section("needs").required_count == 2


# --------------------------------------------------------------------------- validation


def test_batch_arithmetic_message_shows_the_numbers(in_tmp, host):
    write(
        in_tmp / "exp.yaml",
        """
        policy:
          num_workers: 2
          train_micro_batch_size: 4
          train_global_batch_size: 30
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_config("exp.yaml", host=host)
    message = str(err.value)
    assert (
        "policy.train_global_batch_size=30 is not divisible by policy.train_micro_batch_size (4) x "
        "data-parallel size (2) = 8. Use policy.train_global_batch_size=32, or policy.train_micro_batch_size=3."
        in message
    )
    assert (
        "Where set: policy.num_workers at exp.yaml:2; policy.train_global_batch_size at exp.yaml:4; "
        "policy.train_micro_batch_size at exp.yaml:3." in message
    )
    # Either suggestion passes.
    assert load_config("exp.yaml", ["policy.train_global_batch_size=32"], host=host).data_parallel_size == 2
    assert load_config("exp.yaml", ["policy.train_micro_batch_size=3"], host=host).data_parallel_size == 2


def test_parallelism_must_divide_workers(host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"policy": {"num_workers": 3, "tensor_parallel_size": 2}}, host=host)
    assert (
        "policy.num_workers=3 is not divisible by policy.tensor_parallel_size (2) = 2. Use policy.num_workers=4."
    ) in str(err.value)

    with pytest.raises(ConfigError, match=r"policy.train_micro_batch_size must be at least 1, found 0"):
        config_from_dict({"policy": {"train_micro_batch_size": 0}}, host=host)


def test_a_backend_section_adds_its_model_parallel_sizes(host):
    """A policy backend's own section may split a replica further (replica_factors): core
    divides the workers by every factor and names the backend's keys."""
    policy = {"backend": "toy_backend", "num_workers": 4, "tensor_parallel_size": 1, "toy_backend": {"shards": 2}}
    config = config_from_dict({"policy": {**policy, "train_global_batch_size": 8, "train_micro_batch_size": 2}},
                              host=host)
    assert config.replica_factors() == [("policy.tensor_parallel_size", 1), ("policy.toy_backend.shards", 2)]
    assert config.data_parallel_size == 2
    with pytest.raises(ConfigError) as err:
        config_from_dict({"policy": {**policy, "num_workers": 3}}, host=host)
    assert (
        "policy.num_workers=3 is not divisible by policy.tensor_parallel_size (1) x policy.toy_backend.shards (2) "
        "= 2. Use policy.num_workers=4."
    ) in str(err.value)
    with pytest.raises(ConfigError, match=r"policy.toy_backend.shards must be at least 1, found 0"):
        config_from_dict({"policy": {**policy, "toy_backend": {"shards": 0}}}, host=host)
    with pytest.raises(ConfigError, match=r"data-parallel size \(2\) = 6\. Use policy.train_global_batch_size=12, or "
                                          r"policy.train_micro_batch_size=2\."):
        config_from_dict({"policy": {**policy, "train_global_batch_size": 8, "train_micro_batch_size": 3}}, host=host)


def test_unknown_data_plane(host):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"data_plane": {"backend": "tq"}}, host=host)
    assert str(err.value).startswith(
        "data_plane.backend: unknown data plane 'tq'; installed: memory (from toy-plugin)."
    )


def test_require_registered(host):
    factory = host.data_planes["memory"]
    assert require_registered(host.data_planes, "memory", "data_plane.backend") is factory
    with pytest.raises(ConfigError) as err:
        require_registered(host.policy_backends, "megatrn", "policy.backend")
    assert str(err.value) == (
        "policy.backend: unknown policy backend 'megatrn'; installed: none (install a plugin that provides one)."
    )


def test_plugin_validation_error_propagates(host):
    with pytest.raises(ConfigError, match=r"toy.num_generations=32 is above the limit of 16"):
        config_from_dict({"toy": {"num_generations": 32}}, host=host)


# --------------------------------------------------------------------------- dump


def test_dump_then_load_round_trips(in_tmp, host):
    write(
        in_tmp / "exp.yaml",
        r"""
        run_dir: "1e5"
        policy:
          model: /models/a
          optimizer: {lr: 3.0e-6, betas: [0.9, 0.95]}
          max_grad_norm: null
          toy_backend: {shards: 2}
        generation:
          model: ${policy.model}
          stop_strings: ["yes", '\${literal}', "2024-01-01"]
        environments:
          math: {verifier: strict, limits: [1, 2]}
        toy: {tags: [x], weights: {a: 0.25}, cap: 9}
        """,
    )
    config = load_config("exp.yaml", host=host)
    assert config.generation.stop_strings == ["yes", "${literal}", "2024-01-01"]
    write(in_tmp / "dumped.yaml", dump_config(config))
    again = load_config("dumped.yaml", host=host)
    assert again == config
    assert again.run_dir == "1e5" and again.generation.model == "/models/a"
    assert again.section("toy").cap == 9
    assert again != load_config("dumped.yaml", ["toy.cap=8"], host=host)  # sections take part in ==


def test_an_algorithm_s_rows_per_call_fills_only_what_the_user_left_null():
    from posttrain.config.schema import GenerationConfig

    assert GenerationConfig().with_rows_per_call(36).rows_per_call == 36
    assert GenerationConfig(rows_per_call=8).with_rows_per_call(36).rows_per_call == 8
    assert GenerationConfig().with_rows_per_call(0).rows_per_call == 1  # no call brings fewer than one row
