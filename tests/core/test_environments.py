"""Environment containment (plain), and environments hosted in the driver or in Ray actors."""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from posttrain.errors import ConfigError, NodeLost, PluginError, WorkerError
from posttrain.run.environments import (
    EnvironmentActor,
    EnvironmentFailed,
    EnvironmentTimeout,
    LocalEnvironment,
    RemoteEnvironment,
    check_failures,
    check_return,
    metrics_contained,
    start_environments,
    step_contained,
)
from tests.core.misbehaving_environments import Flaky

PLUGINS = ["tests.core.misbehaving_environments"]


def logs(*contents: str) -> list[list[dict]]:
    return [[{"role": "user", "content": "go"}, {"role": "assistant", "content": c}] for c in contents]


# ----------------------------------------------------------------------------- plain containment


def test_a_final_return_ends_every_episode_and_keeps_only_real_errors():
    from posttrain.interfaces import EnvironmentReturn

    result = EnvironmentReturn.final([1, 0.5], [{"a": 1}, None], answers=["x", None], errors=[None, None])
    check_return("final", result, 2)
    assert result.rewards.dtype == torch.float32 and result.rewards.tolist() == [1.0, 0.5]
    assert result.terminateds.tolist() == [True, True] and result.next_stop_strings == [None, None]
    assert result.metadata == [{"a": 1}, None] and result.answers == ["x", None]
    assert result.errors == []  # no sample failed
    assert EnvironmentReturn.final(torch.zeros(2), [0, 1], errors=[None, "boom"]).errors == [None, "boom"]


def test_a_good_step_passes_through():
    step = step_contained("flaky", Flaky(reward=0.5), logs("a", "b"), [{"i": 0}, {"i": 1}])
    assert (step.errors, step.timeouts) == (0, 0)
    assert step.result.rewards.tolist() == [0.5, 0.5]
    assert step.result.metadata == [{"i": 0, "seen": "a"}, {"i": 1, "seen": "b"}]


def test_an_exception_fails_only_the_sample_it_is_raised_for():
    """The call is split until the sample the environment raises on is alone: its
    neighbours are scored as if it were not there."""
    step = step_contained("flaky", Flaky(), logs("a", "raise", "c"), [{"i": 0}, {"i": 1}, {"i": 2}])
    assert (step.errors, step.timeouts) == (1, 0)
    assert step.retried == 3 + 2  # [a, raise, c] failed: [a] and [raise, c] sent again; then [raise] and [c]
    assert step.failed == [False, True, False]
    assert step.result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert step.result.terminateds.tolist() == [False, True, False]
    assert step.result.metadata == [{"i": 0, "seen": "a"}, {"i": 1}, {"i": 2, "seen": "c"}]  # the failed one unchanged
    assert step.result.errors == [None, "RuntimeError: asked to raise", None]
    assert [o["content"] for o in step.result.observations] == ["ok", "", "ok"]


def test_an_environment_that_always_raises_fails_every_sample():
    step = step_contained("flaky", Flaky(), logs("raise", "raise"), [{}, {}])
    assert (step.errors, step.timeouts, step.failed) == (2, 0, [True, True])
    assert step.result.rewards.tolist() == [0.0, 0.0]
    assert step.result.errors == ["RuntimeError: asked to raise"] * 2


def test_wrong_length_is_an_error_naming_the_environment_and_lengths():
    with pytest.raises(PluginError, match=r"environment 'flaky' returned 2 observations for 3 message logs; expected one per message log \(3\)"):
        check_return("flaky", Flaky().step(logs("a", "short", "c"), [{}, {}, {}]), 3)
    step = step_contained("flaky", Flaky(), logs("a", "short", "c"), [{}, {}, {}])
    assert (step.errors, step.timeouts) == (1, 0)
    assert step.result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert step.result.errors[1] == (
        "PluginError: environment 'flaky' returned 0 observations for 1 message logs; expected one per message log (1)"
    )


def test_a_dead_actor_or_a_deadline_is_retried_within_the_bound():
    class FailsTwice(Flaky):
        """What a RemoteEnvironment raises: its actor died, then it passed its deadline."""

        calls = 0

        def step(self, message_logs, metadata):
            self.calls += 1
            if self.calls == 1:
                raise WorkerError("environment 'flaky' actor died during step(): killed")
            if self.calls == 2:
                raise EnvironmentTimeout("environment 'flaky' did not answer step() within 4 s")
            return super().step(message_logs, metadata)

    step = step_contained("flaky", FailsTwice(), logs("a", "b"), [{}, {}], call_retries=2)
    assert (step.errors, step.timeouts, step.retried) == (0, 0, 4)
    assert step.result.rewards.tolist() == [1.0, 1.0]
    step = step_contained("flaky", FailsTwice(), logs("a", "b"), [{}, {}], call_retries=1)
    assert (step.errors, step.timeouts, step.retried, step.failed) == (0, 2, 2, [True, True])
    assert step.result.errors[0] == "EnvironmentTimeout: environment 'flaky' did not answer step() within 4 s"
    step = step_contained("flaky", FailsTwice(), logs("a", "b"), [{}, {}])
    assert (step.errors, step.timeouts, step.retried) == (2, 0, 0)
    assert step.result.errors[0] == "WorkerError: environment 'flaky' actor died during step(): killed"


def test_check_return_refuses_other_types_and_shapes():
    good = Flaky().step(logs("a", "b"), [{}, {}])
    with pytest.raises(PluginError, match=r"environment 'x' returned dict from step\(\); expected an EnvironmentReturn"):
        check_return("x", {}, 2)
    with pytest.raises(PluginError, match=r"returned a Tensor\(2, 1\) of rewards for 2 message logs"):
        check_return("x", attrs.evolve(good, rewards=torch.zeros(2, 1)), 2)
    check_return("x", attrs.evolve(good, errors=[], answers=[]), 2)  # empty optional lists are fine
    with pytest.raises(PluginError, match=r"returned 3 reward_components\['format'\] for 2 message logs"):
        check_return("x", attrs.evolve(good, reward_components={"format": torch.zeros(3)}), 2)


def test_a_per_sample_error_costs_only_that_sample():
    step = step_contained("flaky", Flaky(), logs("a", "bad", "c"), [{}, {}, {}])
    assert (step.errors, step.timeouts) == (1, 0)
    assert step.result.rewards.tolist() == [1.0, 0.0, 1.0]
    assert step.result.terminateds.tolist() == [False, True, False]
    with_parts = attrs.evolve(Flaky().step(logs("a", "bad", "c"), [{}, {}, {}]),
                              reward_components={"format": torch.tensor([0.5, 0.5, 0.5])})
    step = step_contained("parts", type("Parts", (), {"step": lambda self, m, d: with_parts})(), logs("a", "b", "c"),
                          [{}, {}, {}])
    assert step.result.reward_components["format"].tolist() == [0.5, 0.0, 0.5]  # the failed sample's parts are 0


def test_a_lost_node_is_never_contained():
    class OnLostNode(Flaky):
        def step(self, message_logs, metadata):
            raise NodeLost("environment 'flaky' died on node 10.0.0.2 (host gpu-02, id 6c91964e0a22) during step()")

        def metrics(self, rewards, metadata):
            raise NodeLost("environment 'flaky' died on node 10.0.0.2 (host gpu-02, id 6c91964e0a22) during metrics()")

    with pytest.raises(NodeLost, match=r"died on node 10\.0\.0\.2 .* during step\(\)"):
        step_contained("flaky", OnLostNode(), logs("a"), [{}])
    with pytest.raises(NodeLost, match=r"during metrics\(\)"):
        metrics_contained("flaky", OnLostNode(), torch.tensor([1.0]), [{}])


def test_failing_metrics_are_dropped():
    class NoMetrics(Flaky):
        def metrics(self, rewards, metadata):
            raise KeyError("accuracy")

    assert metrics_contained("flaky", Flaky(), torch.tensor([1.0, 2.0]), [{}, {}]) == {"total": 3.0}
    assert metrics_contained("flaky", NoMetrics(), torch.tensor([1.0]), [{}]) == {}


def test_the_actor_object_keeps_a_build_error_for_ready():
    actor = EnvironmentActor("broken", {}, PLUGINS)
    with pytest.raises(ConfigError, match="environments.broken.mode"):
        actor.ready()
    working = EnvironmentActor("flaky", {"reward": 2.0}, PLUGINS)
    working.ready()
    assert working.step(logs("a"), [{}]).rewards.tolist() == [2.0]


def test_the_call_deadline_option_is_checked_before_an_actor_starts():
    with pytest.raises(ConfigError) as info:
        RemoteEnvironment("flaky", {"call_timeout_s": "10s"}, plugins=PLUGINS)
    assert str(info.value) == "config key 'environments.flaky.call_timeout_s': expected float, found str '10s'"
    with pytest.raises(ConfigError) as info:
        RemoteEnvironment("flaky", {"call_timeout_s": -1}, plugins=PLUGINS)
    assert str(info.value) == "config key 'environments.flaky.call_timeout_s': expected a number > 0, found -1.0"


# ----------------------------------------------------------------------------- in the driver


def test_in_the_driver_calls_are_contained_as_in_an_actor(tmp_path):
    """The same containment as an actor's: an exception fails its sample alone, a call past
    its deadline fails its samples as timeouts, and the next call builds the environment
    afresh (the hung call is left running on its own thread)."""
    built = tmp_path / "built"
    env = LocalEnvironment("flaky", {"reward": 1.0, "call_timeout_s": 2, "built_marker": str(built)}, plugins=PLUGINS)
    try:
        raised = step_contained("flaky", env, logs("a", "raise"), [{}, {}])
        assert (raised.errors, raised.result.rewards.tolist()) == (1, [1.0, 0.0])
        assert raised.result.errors[1] == "RuntimeError: asked to raise"
        built.unlink()
        start = time.monotonic()
        step = step_contained("flaky", env, logs("sleep", "b"), [{}, {}])
        assert time.monotonic() - start < 30  # not the 120 s the environment sleeps
        assert (step.errors, step.timeouts, step.result.rewards.tolist()) == (0, 2, [0.0, 0.0])
        assert step.result.errors[0] == (
            "EnvironmentTimeout: environment 'flaky' did not answer step() within 2 s "
            "(environments.flaky.call_timeout_s); the call was left running in the driver and the next call starts "
            "a fresh one"
        )
        assert not built.exists()
        after = step_contained("flaky", env, logs("a", "b"), [{"k": 1}, {}])
        assert (after.errors, after.timeouts, after.result.rewards.tolist()) == (0, 0, [1.0, 1.0])
        assert built.exists() and after.result.metadata[0] == {"k": 1, "seen": "a"}
        assert env.metrics(after.result.rewards, after.result.metadata) == {"total": 2.0}
    finally:
        env.shutdown()
        env.shutdown()


def test_an_environment_dropped_after_a_deadline_is_shut_down_once_when_its_call_ends(tmp_path):
    """The call left running in the driver ends after its deadline: the environment it was made
    on is then shut down (its processes would otherwise outlive it), once; an environment whose
    call still runs when its LocalEnvironment shuts down is shut down then, and not again."""
    marker = tmp_path / "shut_down"
    options = {"call_timeout_s": 1, "nap_s": 4, "shutdown_marker": str(marker)}
    env = LocalEnvironment("flaky", options, plugins=PLUGINS)
    try:
        assert step_contained("flaky", env, logs("nap"), [{}]).timeouts == 1
        assert not marker.exists()  # the call still runs
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.read_text() == "shut down\n"
        assert step_contained("flaky", env, logs("a"), [{}]).timeouts == 0  # a fresh environment
        assert step_contained("flaky", env, logs("nap"), [{}]).timeouts == 1
    finally:
        env.shutdown()
    assert marker.read_text() == "shut down\n" * 2  # the second dropped one, its call still running
    time.sleep(4)  # that call ends: it was shut down already
    assert marker.read_text() == "shut down\n" * 2


def test_light_environments_run_in_the_driver_unless_told_otherwise():
    """``math`` and ``guess_number`` declare themselves light: left null, ``in_driver`` puts
    them in this process; ``in_driver: true`` puts any environment there. (``false``, an
    actor of its own, is the test below.)"""
    envs = start_environments(["math", "flaky"], {"math": {"num_workers": 1, "timeout_s": 5}, "flaky": {"in_driver": True}},
                              plugins=PLUGINS)
    try:
        assert {name: type(env).__name__ for name, env in envs.items()} == {"math": "LocalEnvironment",
                                                                            "flaky": "LocalEnvironment"}
        result = envs["math"].step(logs("\\boxed{4}", "5"), [{"answer": "4"}, {"answer": "4"}])
        assert result.rewards.tolist() == [1.0, 0.0]
    finally:
        for env in envs.values():
            env.shutdown()


def test_a_build_error_in_the_driver_is_itself_or_names_the_environment():
    with pytest.raises(ConfigError, match=r"^environments.broken.mode: expected 'on', found 'off'$"):
        LocalEnvironment("broken", plugins=PLUGINS)
    with pytest.raises(PluginError, match=r"^environment 'flaky' failed to start: TypeError: .*'colour'"):
        LocalEnvironment("flaky", {"colour": "red"}, plugins=PLUGINS)


# ----------------------------------------------------------------------------- Ray actors


@pytest.fixture(scope="module")
def flaky(ray_cluster):
    env = RemoteEnvironment("flaky", {"reward": 1.0, "call_timeout_s": 4}, plugins=PLUGINS)
    yield env
    env.shutdown()


@pytest.mark.ray
def test_remote_math_environment_from_the_entry_points(ray_cluster):
    envs = start_environments(["math"], {"math": {"num_workers": 1, "timeout_s": 5, "in_driver": False}})
    try:
        assert isinstance(envs["math"], RemoteEnvironment)
        result = envs["math"].step(logs("\\boxed{4}", "5"), [{"answer": "4"}, {"answer": "4"}])
        assert result.rewards.tolist() == [1.0, 0.0]
        assert envs["math"].metrics(result.rewards, result.metadata) == {"accuracy": 0.5, "answer_rate": 1.0, "verify_timeouts": 0.0}
    finally:
        envs["math"].shutdown()
        envs["math"].shutdown()


@pytest.mark.ray
def test_remote_exceptions_and_bad_results_are_contained(flaky):
    raised = step_contained("flaky", flaky, logs("a", "raise"), [{}, {}])
    assert (raised.errors, raised.result.rewards.tolist()) == (1, [1.0, 0.0])
    assert "asked to raise" in raised.result.errors[1]
    short = step_contained("flaky", flaky, logs("short", "b"), [{}, {}])
    assert (short.errors, short.result.rewards.tolist()) == (1, [0.0, 1.0])
    assert "environment 'flaky' returned 0 observations for 1 message logs" in short.result.errors[0]
    partial = step_contained("flaky", flaky, logs("bad", "b"), [{}, {}])
    assert (partial.errors, partial.result.rewards.tolist()) == (1, [0.0, 1.0])
    good = step_contained("flaky", flaky, logs("a"), [{"k": 1}])
    assert (good.errors, good.result.metadata) == (0, [{"k": 1, "seen": "a"}])


@pytest.mark.ray
def test_a_call_past_its_deadline_is_contained_and_the_next_call_works(flaky):
    start = time.monotonic()
    step = step_contained("flaky", flaky, logs("sleep", "b", "c"), [{}, {}, {}])
    assert time.monotonic() - start < 60  # not the 120 s the environment sleeps
    assert (step.errors, step.timeouts) == (0, 3)
    assert step.result.rewards.tolist() == [0.0, 0.0, 0.0]
    assert "did not answer step() within 4 s (environments.flaky.call_timeout_s); its actor was stopped and the next call starts a fresh one" in step.result.errors[0]
    after = step_contained("flaky", flaky, logs("a", "b"), [{}, {}])  # a fresh actor answers
    assert (after.errors, after.timeouts, after.result.rewards.tolist()) == (0, 0, [1.0, 1.0])


@pytest.mark.ray
def test_a_call_whose_actor_is_killed_is_made_again_on_a_fresh_actor(ray_cluster, tmp_path):
    """SIGKILL of the environment's actor in the middle of a call: the call is made again on
    a fresh actor and every sample is scored as an uninterrupted call scores it."""
    died = tmp_path / "died"
    env = RemoteEnvironment("flaky", {"reward": 0.5, "died_marker": str(died)}, plugins=PLUGINS)
    try:
        step = step_contained("flaky", env, logs("a", "die", "c"), [{"i": 0}, {"i": 1}, {"i": 2}], call_retries=1)
        assert died.exists()
        assert (step.errors, step.timeouts, step.retried) == (0, 0, 3)
        assert step.result.rewards.tolist() == [0.5, 0.5, 0.5]
        assert step.result.metadata == [{"i": 0, "seen": "a"}, {"i": 1, "seen": "die"}, {"i": 2, "seen": "c"}]
    finally:
        env.shutdown()


@pytest.mark.ray
def test_without_retries_a_killed_call_fails_its_samples_and_too_many_stop_the_run(ray_cluster, tmp_path):
    env = RemoteEnvironment("flaky", {"died_marker": str(tmp_path / "died"), "call_retries": 0}, plugins=PLUGINS)
    try:
        step = step_contained("flaky", env, logs("a", "die"), [{}, {}], call_retries=env.core_options.call_retries)
    finally:
        env.shutdown()
    assert (step.errors, step.timeouts, step.retried, step.failed) == (2, 0, 0, [True, True])
    assert step.result.errors[0].startswith("WorkerError: environment 'flaky' actor died during step(): ")
    failures = [("train.jsonl row 7", error) for error in step.result.errors]
    with pytest.raises(EnvironmentFailed, match=r"^environment 'flaky' could not score 2 of 3 samples of a rollout, "
                       r"more than environments.flaky.max_failed_fraction=0.5 allows .* environments.flaky.call_retries=0 "
                       r"times\). The first: train.jsonl row 7: WorkerError: environment 'flaky' actor died during step\(\)"):
        check_failures("flaky", env.core_options, failures, 3)
    check_failures("flaky", attrs.evolve(env.core_options, max_failed_fraction=1.0), failures, 3)  # the advice works


@pytest.mark.ray
def test_unknown_names_fail_before_any_actor_starts(ray_cluster, tmp_path):
    marker = tmp_path / "flaky_built"
    with pytest.raises(PluginError) as info:
        start_environments(["flaky", "mth"], {"flaky": {"built_marker": str(marker)}}, plugins=PLUGINS)
    message = str(info.value)
    assert message.startswith("unknown environment 'mth'; installed: ")
    assert "math, guess_number (from posttrain-env-math 0.1.0)" in message
    assert message.endswith("Did you mean 'math'?")
    assert not marker.exists()
    with pytest.raises(PluginError, match="unknown environment 'gues_number'"):  # a configured but unused name
        start_environments([], {"gues_number": {}})


@pytest.mark.ray
def test_a_build_error_reaches_the_driver_as_itself(ray_cluster):
    with pytest.raises(ConfigError, match=r"^environments.broken.mode: expected 'on', found 'off'$"):
        RemoteEnvironment("broken", plugins=PLUGINS)
