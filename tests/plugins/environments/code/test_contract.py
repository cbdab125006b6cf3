"""The conformance kit's environment contract, for ``code``."""

from __future__ import annotations

from posttrain.testing import EnvironmentCase, EnvironmentContract

pytest_plugins = ["posttrain.testing.pytest_plugin"]


def _reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "Write add(a, b)."}, {"role": "assistant", "content": text}]


_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}


class TestCodeContract(EnvironmentContract):
    name = "code"
    options = {"timeout_s": 5, "max_concurrency": 2}
    sample_inputs = EnvironmentCase(
        message_logs=[
            _reply("```python\ndef add(a, b):\n    return a + b\n```"),
            _reply("def add(a, b):\n    return a * b"),
            _reply("```python\nprint(sum(map(int, input().split())))\n```"),
        ],
        metadata=[_TESTS, _TESTS, {"cases": [{"input": "2 3", "output": "5"}]}],
        expected_rewards=[1.0, 0.5, 1.0],
    )
