"""The reverse environment, checked by posttrain's conformance kit and by its own tests."""

from __future__ import annotations

import pytest

from posttrain.config import config_from_dict
from posttrain.errors import ConfigError, DataError
from posttrain.testing import EnvironmentCase, EnvironmentContract

pytest_plugins = ["posttrain.testing.pytest_plugin"]


def _log(prompt: str, answer: str | None) -> list[dict[str, str]]:
    log = [{"role": "user", "content": f"Reverse: {prompt}"}]
    if answer is not None:
        log.append({"role": "assistant", "content": answer})
    return log


CASE = EnvironmentCase(
    message_logs=[_log("abc", "cba"), _log("hello", "hello"), _log("xy", " yx\n"), _log("q", None)],
    metadata=[{"text": "abc"}, {"text": "hello"}, {"text": "xy"}, {"text": "q"}],
    expected_rewards=[1.0, 0.0, 1.0, 0.0],
)


class TestReverseContract(EnvironmentContract):
    name = "reverse"
    sample_inputs = CASE


def test_episode_ends_and_answers_are_reported(posttrain_host):
    env = posttrain_host.environments["reverse"]({})
    result = env.step(CASE.message_logs, CASE.metadata)
    assert result.terminateds.tolist() == [True] * 4
    assert result.answers == ["cba", "hello", " yx\n", None]
    assert env.metrics(result.rewards, result.metadata) == {"accuracy": 0.5}


def test_only_the_last_assistant_message_counts(posttrain_host):
    env = posttrain_host.environments["reverse"]({})
    log = [*_log("ab", "ba"), {"role": "user", "content": "again"}, {"role": "assistant", "content": "ab"}]
    assert env.step([log], [{"text": "ab"}]).rewards.tolist() == [0.0]


def test_missing_text_names_the_sample(posttrain_host):
    env = posttrain_host.environments["reverse"]({})
    with pytest.raises(DataError, match=r"sample 1 needs metadata \{'text': str\}, got \{'txt': 'b'\}"):
        env.step([_log("a", "a"), _log("b", "b")], [{"text": "a"}, {"txt": "b"}])


def test_ignore_case_is_an_option(posttrain_host):
    env = posttrain_host.environments["reverse"]({"ignore_case": True})
    assert env.step([_log("Abc", "CBA"), _log("ab", "bb")], [{"text": "Abc"}, {"text": "ab"}]).rewards.tolist() == [1.0, 0.0]
    strict = posttrain_host.environments["reverse"]({})
    assert strict.step([_log("Abc", "CBA")], [{"text": "Abc"}]).rewards.tolist() == [0.0]


def test_options_are_checked_when_the_config_is_loaded(posttrain_host):
    """posttrain reads environments.reverse into ReverseOptions (declared on the factory),
    next to core's own call_timeout_s, before anything starts."""
    config = config_from_dict({"environments": {"reverse": {"ignore_case": True, "call_timeout_s": 30}}}, host=posttrain_host)
    assert config.environments["reverse"] == {"ignore_case": True, "call_timeout_s": 30}
    with pytest.raises(ConfigError) as info:
        config_from_dict({"environments": {"reverse": {"ignore_cas": True}}}, host=posttrain_host)
    assert str(info.value) == (
        "unknown config key 'environments.reverse.ignore_cas' (at <dict>). Did you mean 'environments.reverse.ignore_case'?"
    )
    with pytest.raises(ConfigError) as info:
        config_from_dict({"environments": {"reverse": {"ignore_case": "yes"}}}, host=posttrain_host)
    assert str(info.value) == "config key 'environments.reverse.ignore_case' (at <dict>): expected bool, found str 'yes'"
