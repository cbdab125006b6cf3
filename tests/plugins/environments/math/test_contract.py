"""The conformance kit's environment contract, for ``math`` and ``guess_number``."""

from __future__ import annotations

from posttrain.testing import EnvironmentCase, EnvironmentContract

pytest_plugins = ["posttrain.testing.pytest_plugin"]


def _reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "Go."}, {"role": "assistant", "content": text}]


class TestMathContract(EnvironmentContract):
    name = "math"
    options = {"num_workers": 1, "timeout_s": 10}
    sample_inputs = EnvironmentCase(
        message_logs=[_reply("\\boxed{3}"), _reply("The answer is 2/4."), _reply("no")],
        metadata=[{"answer": "3"}, {"answer": "\\frac{1}{2}"}, {"answer": "1"}],
        expected_rewards=[1.0, 1.0, 0.0],
    )


class TestGuessNumberContract(EnvironmentContract):
    name = "guess_number"
    sample_inputs = EnvironmentCase(
        message_logs=[_reply("<guess>4</guess>"), _reply("<guess>9</guess>"), _reply("five")],
        metadata=[{"target": 4}, {"target": 5}, {"target": 5}],
        expected_rewards=[1.0, 0.0, 0.0],
    )
