"""The multi-turn ``guess_number`` environment, turn by turn."""

from __future__ import annotations

import pytest

from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain_env_math.guess_number import STOP, GuessNumberEnvironment, guess_number_prompt, parse_guess
from posttrain_env_math.options import GuessNumberOptions


def play(env, replies, meta):
    """Feed ``replies`` one turn at a time, as the rollout does; return each turn's results."""
    log = list(guess_number_prompt(meta.get("low", 1), meta.get("high", 100)))
    turns = []
    for reply in replies:
        log.append({"role": "assistant", "content": reply})
        result = env.step([log], [meta])
        turns.append((result.observations[0]["content"], float(result.rewards[0]), bool(result.terminateds[0]), result.next_stop_strings[0]))
        meta = result.metadata[0]
        if turns[-1][2]:
            break
        log.append(result.observations[0])
    return turns, meta


def test_higher_lower_then_solved():
    env = GuessNumberEnvironment(GuessNumberOptions(max_guesses=5))
    turns, meta = play(env, ["<guess>50</guess>", "<guess>20</guess>", "hmm", "<guess>37</guess>"], {"target": 37})
    assert turns == [
        ("Lower.", 0.0, False, [STOP]),
        ("Higher.", 0.0, False, [STOP]),
        ("Reply with <guess>N</guess>, N an integer from 1 to 100.", 0.0, False, [STOP]),
        ("", 1.0, True, None),
    ]
    assert meta == {"target": 37, "guesses": 4, "solved": True}


def test_out_of_guesses():
    env = GuessNumberEnvironment(GuessNumberOptions(max_guesses=2))
    turns, meta = play(env, ["<guess>1</guess>", "<guess>2</guess>", "<guess>3</guess>"], {"target": 3, "low": 1, "high": 3})
    assert turns == [("Higher.", 0.0, False, [STOP]), ("", 0.0, True, None)]
    assert meta["solved"] is False and meta["guesses"] == 2


def test_batch_and_metrics():
    env = GuessNumberEnvironment(GuessNumberOptions())
    logs = [[{"role": "assistant", "content": c}] for c in ["<guess>7</guess>", "<guess>-2</guess>", "seven"]]
    result = env.step(logs, [{"target": 7}, {"target": 7}, {"target": 7}])
    assert result.rewards.tolist() == [1.0, 0.0, 0.0]
    assert result.terminateds.tolist() == [True, False, False]
    assert result.answers == ["7", "-2", "None"]
    assert env.metrics(result.rewards, result.metadata) == {"solved": 1 / 3, "mean_guesses": 1.0}


def test_parse_guess_takes_the_last_tag():
    assert parse_guess("<guess>3</guess> no, <guess> 12 </guess>") == 12
    assert parse_guess("<guess>three</guess> 4") is None


def test_options_are_checked_when_the_config_is_loaded():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"environments": {"guess_number": {"max_turns": 3}}})
    assert str(info.value) == (
        "unknown config key 'environments.guess_number.max_turns' (at <dict>). "
        "Did you mean 'environments.guess_number.max_guesses'?"
    )
    with pytest.raises(ConfigError) as info:
        config_from_dict({"environments": {"guess_number": {"colour": "red"}}})
    assert str(info.value) == (
        "unknown config key 'environments.guess_number.colour' (at <dict>). Valid keys here: call_retries, "
        "call_timeout_s, in_driver, max_failed_fraction, max_guesses."
    )
