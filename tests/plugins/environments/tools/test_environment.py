"""The tools environment on its own: calls answered by tool messages, answers scored by the
reward environment, and every way a call can fail contained and counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.config.environments import read_environment_options
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain_env_tools.environment import ToolsEnvironment
from posttrain_env_tools.options import ToolsOptions

REPO = Path(__file__).resolve().parents[4]
FUNCTIONS = "tests.plugins.environments.tools.tool_functions"


@pytest.fixture
def importable_test_tools(monkeypatch):
    """The pool's worker processes import the test tools by reference."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def episode(answer: str, **metadata):
    log = [{"role": "user", "content": "What is 12345+67890?"}, {"role": "assistant", "content": answer}]
    return log, {"answer": "80235", **metadata}


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_step_answers_calls_scores_answers_and_contains_every_failure(importable_test_tools):
    options = ToolsOptions(tools=["calculator", f"{FUNCTIONS}:hang", f"{FUNCTIONS}:fail"], tool_timeout_s=1.0,
                           max_tool_calls=4)
    env = ToolsEnvironment(options)
    try:
        assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator", "hang", "fail"]
        cases = [
            episode(call("calculator", expression="12345+67890")),
            episode("The sum is 80235."),
            episode("The sum is 80234."),
            episode(call("search", query="12345+67890")),
            episode('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}'),
            episode(call("hang", seconds=30) + call("calculator", expression="2*21")),
            episode(call("fail", message="boom")),
            episode(call("calculator", expression="1+1"), tools={"tool_calls": 4}),
        ]
        result = env.step([log for log, _ in cases], [meta for _, meta in cases])
    finally:
        env.shutdown()
    replies = [o["content"] for o in result.observations]
    assert replies == [
        "80235",
        "",
        "",
        "error: there is no tool 'search'; the tools are calculator, hang, fail",
        "error: malformed tool call: a <tool_call> is not closed by </tool_call>",
        "error: hang did not finish within 1 s\n42",
        "error: ValueError: boom",
        "",
    ]
    assert all(o["role"] == "tool" for o in result.observations)
    assert result.terminateds.tolist() == [False, True, True, False, False, False, False, True]
    assert result.rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    counts = [m["tools"] for m in result.metadata]
    assert counts[5] == {"tool_calls": 2, "malformed_calls": 0, "unknown_tool_calls": 0, "tool_errors": 0,
                         "tool_timeouts": 1, "over_budget": 0}
    assert counts[3]["unknown_tool_calls"] == 1 and counts[4]["malformed_calls"] == 1 and counts[6]["tool_errors"] == 1
    assert counts[7]["over_budget"] == 1  # a fifth call past max_tool_calls=4 ends the episode
    assert result.metadata[1]["answer"] == "80235"  # the reward environment's metadata, with the counts
    metrics = env.metrics(result.rewards, result.metadata)
    assert metrics["tool_timeouts"] == 1 / 8 and metrics["tool_calls"] == (1 + 1 + 2 + 1 + 5) / 8


def test_a_malformed_call_can_end_the_episode():
    env = ToolsEnvironment(ToolsOptions(malformed_call="end"))
    try:
        result = env.step(*zip(episode("<tool_call>2+2</tool_call>"), strict=True))
    finally:
        env.shutdown()
    assert result.terminateds.tolist() == [True] and result.rewards.tolist() == [0.0]
    assert result.metadata[0]["tools"]["malformed_calls"] == 1


def test_options_are_checked_when_the_config_is_read():
    factory = plugin_host().environments["tools"]
    read = read_environment_options("tools", factory, {"tools": ["python"], "format": "llama3_json"})
    assert read.own == ToolsOptions(tools=["python"], format="llama3_json")
    with pytest.raises(ConfigError, match="environments.tools.format"):
        read_environment_options("tools", factory, {"format": "xml"})
    with pytest.raises(ConfigError, match="Did you mean 'environments.tools.max_tool_calls'"):
        read_environment_options("tools", factory, {"max_tools_calls": 3})
    with pytest.raises(ConfigError) as error:
        read_environment_options("tools", factory, {"reward": "mth"})
    assert "environments.tools.reward" in str(error.value) and "Did you mean 'math'?" in str(error.value)
