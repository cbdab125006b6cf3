"""Automatic restarts (checkpointing.max_restarts): which failures start the run again, how many
times, and after how long. The whole path (a worker killed, the CLI run restarting itself from
its checkpoint, metrics equal to an uninterrupted run's) is in tests/e2e/test_faults.py."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError

from posttrain.config.schema import CheckpointConfig, RunConfig
from posttrain.errors import ConfigError, NodeLost, ProcessDied, WorkerError
from posttrain.run import restarts
from posttrain.run.restarts import died, run_with_restarts


def death(message: str = "worker group 'policy' rank 0 died on node head") -> WorkerError:
    failure = WorkerError(message)
    failure.__cause__ = RayActorError()
    return failure


def raised() -> WorkerError:
    failure = WorkerError("worker group 'policy' rank 0: train() raised ValueError: bad shape")
    failure.__cause__ = ValueError("bad shape")
    return failure


def failing(*failures: BaseException):
    """A run that raises ``failures`` in turn, then returns {"step": 5}; its calls are counted."""
    calls: list[int] = []

    def run(config: RunConfig) -> dict:
        calls.append(len(calls))
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return {"step": 5}

    return run, calls


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(restarts.time, "sleep", slept.append)
    return slept


def config(tmp_path, max_restarts: int, **checkpointing) -> RunConfig:
    return RunConfig(run_dir=str(tmp_path), checkpointing=CheckpointConfig(max_restarts=max_restarts,
                                                                            restart_backoff_s=2.0, **checkpointing))


def test_deaths_restart_the_run_with_a_doubling_wait(tmp_path, waits):
    run, calls = failing(death(), NodeLost("worker group 'policy' rank 1 died on node n2: node lost"))
    assert run_with_restarts(config(tmp_path, 2), run) == {"step": 5}
    assert len(calls) == 3 and waits == [2.0, 4.0]


def test_past_max_restarts_the_death_is_raised(tmp_path, waits):
    run, calls = failing(death(), death("worker group 'generation' rank 0 died on node head"))
    with pytest.raises(WorkerError, match="worker group 'generation' rank 0 died"):
        run_with_restarts(config(tmp_path, 1), run)
    assert len(calls) == 2 and waits == [2.0]


@pytest.mark.parametrize("failure", [raised(), ConfigError("policy.model: no such folder"), KeyboardInterrupt()],
                         ids=["a-method-raised", "config-error", "interrupt"])
def test_what_a_restart_would_meet_again_is_raised_at_once(tmp_path, waits, failure):
    run, calls = failing(failure)
    with pytest.raises(type(failure)):
        run_with_restarts(config(tmp_path, 3), run)
    assert len(calls) == 1 and waits == []


def test_without_checkpoints_there_is_nothing_to_restart_from(tmp_path, waits):
    run, calls = failing(death())
    with pytest.raises(WorkerError):
        run_with_restarts(config(tmp_path, 3, enabled=False), run)
    assert len(calls) == 1


def test_a_death_is_told_from_a_method_that_raised():
    init_failed = RayActorError(actor_init_failed=True)
    failure = WorkerError("worker group 'policy' rank 0: __init__() raised ImportError")
    failure.__cause__ = init_failed
    assert died(death()) and not died(raised()) and not died(failure) and died(NodeLost("node lost"))
    # a method that raised because another process of the run died under it (an engine during a refit)
    assert died(ProcessDied("worker group 'policy' rank 0: send_weights() raised ProcessDied: weight sync: ..."))


def test_a_negative_max_restarts_is_refused(yaml_file):
    from posttrain.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(yaml_file("checkpointing:\n  max_restarts: -1\n"))
    assert str(info.value) == ("config key 'checkpointing' (at exp.yaml:1): max_restarts must be at least 0 "
                               "(0: no automatic restart), found -1")
