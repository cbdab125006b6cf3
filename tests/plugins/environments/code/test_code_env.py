"""The ``code`` environment: code extraction, rewards from tests and I/O cases, statuses,
metrics and options."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain.plugins import new_plugin_host
from posttrain_env_code.environment import CodeEnvironment
from posttrain_env_code.extract import extract_code
from posttrain_env_code.options import CodeOptions

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(CodeOptions(timeout_s=TIMEOUT_S, memory_mb=256, max_concurrency=2))
    yield environment
    environment.shutdown()


def reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "Write it."}, {"role": "assistant", "content": text}]


ADD_TESTS = {
    "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
}
SUM_CASES = {
    "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}, {"input": "-3 1", "output": "-2"}]
}


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("Here:\n```python\nx = 1\n```\nDone.", "x = 1\n"),
        ("```py\na = 1\n```\nthen\n```python3\nb = 2\n```", "b = 2\n"),  # the last Python block
        ("```bash\nls\n```\n```\nc = 3\n```", "c = 3\n"),  # no Python block: the last untagged one
        ("```python\nd = 4\n```\n```\nnot this\n```", "d = 4\n"),  # a Python block wins over untagged
        ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut off before the closing fence
        ("print('hi')", "print('hi')"),  # no fence: the whole reply
        ("```Python extra words\ne = 5\n```", "e = 5\n"),
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


# ----------------------------------------------------------------------------- rewards


def test_rewards_are_the_fraction_of_tests_passed(env):
    logs = [
        reply("```python\ndef add(a, b):\n    return a + b\n```"),  # 4/4
        reply("def add(a, b):\n    return a * b"),  # only add(2, 2) and ... -> 1/4 (2*2 == 4)
        reply("```python\nprint(sum(map(int, input().split())))\n```"),  # 3/3 cases
        reply("print(abs(sum(map(int, input().split()))))"),  # 2/3: -3 1 prints 2
        reply("Sure:\n```python\n    def add(a, b):\n        return a + b\n```"),  # indented block: dedented, 4/4
        reply("I do not know."),  # not Python: a SyntaxError, 0/4
        reply(""),  # nothing to run
    ]
    meta = [ADD_TESTS, ADD_TESTS, SUM_CASES, SUM_CASES, ADD_TESTS, ADD_TESTS, ADD_TESTS]
    result = env.step(logs, meta)
    torch.testing.assert_close(result.rewards, torch.tensor([1.0, 1 / 4, 1.0, 2 / 3, 1.0, 0.0, 0.0]))
    assert [m["tests_passed"] for m in result.metadata] == [4, 1, 3, 2, 4, 0, 0]
    assert [m["tests_total"] for m in result.metadata] == [4, 4, 3, 3, 4, 4, 4]
    statuses = ["passed", "failed", "passed", "failed", "passed", "error", "no_code"]
    assert [m["code_status"] for m in result.metadata] == statuses
    assert result.metadata[0]["code"] == "def add(a, b):\n    return a + b"
    assert result.metadata[0]["tests"] == ADD_TESTS["tests"]  # the input metadata is kept
    assert result.answers[2] == "print(sum(map(int, input().split())))"
    assert result.terminateds.all() and result.errors == []
    assert [o["content"] for o in result.observations] == [""] * 7

    metrics = env.metrics(result.rewards, result.metadata)
    expected_pass_rate = (1 + 1 / 4 + 1 + 2 / 3 + 1 + 0 + 0) / 7
    assert metrics == pytest.approx(
        {
            "pass_rate": expected_pass_rate,
            "solve_rate": 3 / 7,
            "timeouts": 0.0,
            "memory_kills": 0.0,
            "errors": 1.0,
            "no_code": 1.0,
        }
    )


def test_tests_and_cases_together_and_output_comparison(env):
    program = "def double(x):\n    return 2 * x\nif __name__ == '__main__':\n    print(double(int(input())), '  ')\n    print()\n"
    meta = {
        "tests": ["assert double(2) == 4", "assert double(3) == 7"],
        "cases": [{"input": "4", "output": "8"}, {"input": "1", "output": "3"}],
    }
    result = env.step([reply(program)], [meta])
    # trailing spaces and blank lines are ignored; double(3) == 7 and the second case fail
    assert result.rewards.tolist() == [0.5]
    assert result.metadata[0]["tests_passed"] == 2


def test_a_case_fails_on_a_nonzero_exit_even_with_the_right_output(env):
    result = env.step([reply("print(3)\nraise SystemExit(2)")], [{"cases": [{"input": "", "output": "3"}]}])
    assert result.rewards.tolist() == [0.0]
    assert result.metadata[0]["code_status"] == "error"


def test_all_or_nothing_reward():
    environment = CodeEnvironment(CodeOptions(reward="all", timeout_s=TIMEOUT_S))
    try:
        result = environment.step(
            [reply("def add(a, b):\n    return a + b"), reply("def add(a, b):\n    return a * b")],
            [ADD_TESTS, ADD_TESTS],
        )
    finally:
        environment.shutdown()
    assert result.rewards.tolist() == [1.0, 0.0]
    assert [m["tests_passed"] for m in result.metadata] == [4, 1]


def test_early_exit_does_not_pass_tests(env):
    logs = [reply("import os\nos._exit(0)"), reply("import sys\nsys.exit(0)"), reply("print('All tests passed')")]
    result = env.step(logs, [ADD_TESTS] * 3)
    assert result.rewards.tolist() == [0.0, 0.0, 0.0]


def test_timeouts_memory_and_errors_are_told_apart(env):
    logs = [
        reply("while True:\n    pass"),
        reply("block = bytearray(10 << 30)"),
        reply("def add(a, b):\n    return a + b\nraise RuntimeError('boom')"),
        reply("def add(a, b):\n    while True:\n        pass"),  # the program is fine; a test hangs
    ]
    result = env.step(logs, [ADD_TESTS] * 4)
    assert [m["code_status"] for m in result.metadata] == ["timeout", "memory", "error", "timeout"]
    assert result.rewards.tolist() == [0.0, 0.0, 0.0, 0.0]  # a program that raised gets no test run
    metrics = env.metrics(result.rewards, result.metadata)
    assert (metrics["timeouts"], metrics["memory_kills"], metrics["errors"]) == (2.0, 1.0, 1.0)


def test_runs_happen_concurrently_up_to_max_concurrency():
    """Four samples that each sleep 1 s take about 2 s with two runs at a time."""
    import time

    environment = CodeEnvironment(CodeOptions(max_concurrency=2, timeout_s=5))
    try:
        start = time.monotonic()
        result = environment.step(
            [reply("import time\ntime.sleep(1)\ndef f():\n    return 1")] * 4, [{"tests": ["assert f() == 1"]}] * 4
        )
        elapsed = time.monotonic() - start
    finally:
        environment.shutdown()
    assert result.rewards.tolist() == [1.0] * 4
    assert 2.0 <= elapsed < 4.0  # two waves; one at a time would take more than 4 s


def test_malformed_metadata_is_a_per_sample_error(env):
    good = reply("def add(a, b):\n    return a + b")
    meta = [ADD_TESTS, {"answer": "3"}, {"tests": "assert add(1, 2) == 3"}, {"cases": [{"input": "1"}]}, {"tests": []}]
    result = env.step([good] * 5, meta)
    assert result.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.errors[0] is None
    assert "has no tests" in result.errors[1] and "'cases'" in result.errors[1]
    assert "'tests' must be a list of str" in result.errors[2]
    assert "'cases' must be a list of {'input': str, 'output': str}" in result.errors[3]
    assert "holds no tests" in result.errors[4]
    assert [m["code_status"] for m in result.metadata] == ["passed"] + ["invalid"] * 4


# ----------------------------------------------------------------------------- options


def test_the_registered_factory_reads_the_mapping_into_its_options():
    environment = new_plugin_host().environments["code"]({"timeout_s": 2, "reward": "all"})
    try:
        assert environment.options == CodeOptions(timeout_s=2.0, reward="all")
    finally:
        environment.shutdown()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout": 3}, "unknown config key 'environments.code.timeout' (at <dict>). Did you mean 'environments.code.timeout_s'?"),
        (
            {"zzz": 1},
            "unknown config key 'environments.code.zzz' (at <dict>). Valid keys here: call_retries, call_timeout_s, "
            "disk_mb, in_driver, max_concurrency, max_failed_fraction, max_output_bytes, max_processes, memory_mb, namespaces, "
            "reward, timeout_s.",
        ),
        ({"timeout_s": 0}, "config key 'environments.code.timeout_s' (at <dict>): expected a number >= 0.1, found 0.0"),
        ({"memory_mb": 32}, "config key 'environments.code.memory_mb' (at <dict>): expected a number >= 64, found 32"),
        ({"max_output_bytes": 0}, "config key 'environments.code.max_output_bytes' (at <dict>): expected a number >= 1, found 0"),
        ({"max_concurrency": 1.5}, "config key 'environments.code.max_concurrency' (at <dict>): expected int, found float 1.5"),
        ({"max_processes": True}, "config key 'environments.code.max_processes' (at <dict>): expected int, found bool True"),
        (
            {"reward": "fractoin"},
            "config key 'environments.code.reward' (at <dict>): expected one of 'fraction', 'all', found str 'fractoin'. "
            "Did you mean 'fraction'?",
        ),
        (
            {"namespaces": "yes"},
            "config key 'environments.code.namespaces' (at <dict>): expected one of 'auto', 'require', 'off', found str 'yes'",
        ),
    ],
)
def test_option_errors_name_the_key_when_the_config_is_loaded(options, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"environments": {"code": {**options, "call_timeout_s": 30}}})
    assert str(info.value) == message
