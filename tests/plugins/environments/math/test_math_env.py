"""The ``math`` environment: math-verify scoring in a deadline pool, metrics, options."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain.plugins import new_plugin_host
from posttrain_env_math.math_env import MathEnvironment
from posttrain_env_math.options import MathOptions

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def env():
    environment = MathEnvironment(MathOptions(timeout_s=TIMEOUT_S, num_workers=2))
    yield environment
    environment.shutdown()


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": response}]


CASES = [
    # (response, ground truth, reward, extracted answer)
    ("Half of one: \\boxed{\\frac{1}{2}}", "0.5", 1.0, "\\frac{1}{2}"),
    ("The answer is 1/2.", "\\frac{1}{2}", 1.0, "1/2"),
    ("42", "42", 1.0, "42"),
    ("I count 1,000 apples", "1000", 1.0, "1,000"),
    ("so \\boxed{x^2+1}", "1 + x^2", 1.0, "x^2+1"),
    ("The answer is 41", "42", 0.0, "41"),
    ("\\boxed{\\sqrt{2}}", "2", 0.0, "\\sqrt{2}"),
    ("I have no idea.", "7", 0.0, None),
]


def test_hand_written_cases(env):
    logs = [conversation(response) for response, *_ in CASES]
    result = env.step(logs, [{"answer": gold} for _, gold, *_ in CASES])
    assert result.rewards.tolist() == [reward for _, _, reward, _ in CASES]
    assert result.answers == [answer for *_, answer in CASES]
    assert result.terminateds.all()
    assert [o["content"] for o in result.observations] == [""] * len(CASES)
    assert result.errors == []
    assert [m["verify_status"] for m in result.metadata] == ["ok"] * len(CASES)
    assert result.metadata[0] == {"answer": "0.5", "extracted_answer": "\\frac{1}{2}", "verify_status": "ok"}


def test_a_pathological_answer_scores_zero_within_the_deadline_off_the_main_thread(env):
    # verify(1, 99999999!) runs for minutes in sympy; math-verify's own signal timeout cannot run here.
    logs = [conversation("\\boxed{99999999!}"), conversation("\\boxed{3}")]
    out = {}

    def score():
        start = time.monotonic()
        out["result"] = env.step(logs, [{"answer": "1"}, {"answer": "3"}])
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    result = out["result"]
    assert result.rewards.tolist() == [0.0, 1.0]
    assert [m["verify_status"] for m in result.metadata] == ["timeout", "ok"]
    assert out["seconds"] < TIMEOUT_S + 10  # the deadline, plus a replacement start on a busy machine
    assert env.metrics(result.rewards, result.metadata)["verify_timeouts"] == 1.0
    # the replaced worker serves the next call
    assert env.step([conversation("7")], [{"answer": "7"}]).rewards.tolist() == [1.0]


def test_samples_without_ground_truth_are_per_sample_errors(env):
    result = env.step([conversation("5"), conversation("5"), conversation("5")], [{"answer": 5}, {}, {"answer": "  "}])
    assert result.rewards.tolist() == [1.0, 0.0, 0.0]
    assert result.errors[0] is None
    assert "metadata has no 'answer'" in result.errors[1]
    assert "cannot read the ground truth '  '" in result.errors[2]


def test_metrics(env):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    metadata = [
        {"extracted_answer": "1", "verify_status": "ok"},
        {"extracted_answer": None, "verify_status": "ok"},
        {"extracted_answer": None, "verify_status": "timeout"},
        {"extracted_answer": "2", "verify_status": "ok"},
    ]
    assert env.metrics(rewards, metadata) == {"accuracy": 0.5, "answer_rate": 0.5, "verify_timeouts": 1.0}


def test_registered_through_the_entry_point():
    from posttrain_env_math.guess_number import GuessNumberEnvironment

    host = new_plugin_host()
    game = host.environments["guess_number"]({"max_guesses": 3})
    assert isinstance(game, GuessNumberEnvironment) and game.options.max_guesses == 3
    environment = host.environments["math"]({"num_workers": 1})
    assert isinstance(environment, MathEnvironment)
    assert environment.options.num_workers == 1
    environment.shutdown()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timout_s": 1}, "unknown config key 'environments.math.timout_s' (at <dict>). Did you mean 'environments.math.timeout_s'?"),
        ({"num_workers": 0}, "config key 'environments.math.num_workers' (at <dict>): expected a number > 0, found 0"),
        ({"timeout_s": -1}, "config key 'environments.math.timeout_s' (at <dict>): expected a number > 0, found -1.0"),
        ({"num_workers": 1.5}, "config key 'environments.math.num_workers' (at <dict>): expected int, found float 1.5"),
        ({"call_timeout_s": 0}, "config key 'environments.math.call_timeout_s' (at <dict>): expected a number > 0, found 0.0"),
    ],
)
def test_options_are_checked_when_the_config_is_loaded(options, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"environments": {"math": options}})
    assert str(info.value) == message


def test_good_options_and_core_keys_are_accepted():
    config = config_from_dict({"environments": {"math": {"timeout_s": 2, "call_timeout_s": 60}, "guess_number": {}}})
    assert config.environments == {"math": {"timeout_s": 2, "call_timeout_s": 60}, "guess_number": {}}
