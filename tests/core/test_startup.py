"""Starting a run's parts at once: concurrency, failures and a stop during start-up."""

from __future__ import annotations

import abc
import contextlib
import os
import signal
import threading

import pytest

from posttrain.run.startup import Startup
from posttrain.run.stop import StartupInterrupted, StopRequest, stop_on_signals


class Interface(abc.ABC):
    """Like posttrain's interfaces: ``shutdown`` abstract, implemented by each part's class."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class Part(Interface):
    def __init__(self, name: str, shut: list[str]):
        self.name, self.shut = name, shut

    def shutdown(self) -> None:
        self.shut.append(self.name)


def test_parts_build_at_the_same_time_and_cleanup_shuts_each_down_once():
    """Each part is shut down by its own class's ``shutdown`` (not the interface's empty one)."""
    together = threading.Barrier(3, timeout=10)  # passes only if all three build at once
    shut: list[str] = []

    def build(name):
        def make():
            together.wait()
            return Part(name, shut)

        return make

    with contextlib.ExitStack() as cleanup:
        startup = Startup(cleanup)
        started = [startup.start(name, build(name)) for name in ("policy", "generation", "environments")]
        seconds = startup.wait()
        assert [part.value.name for part in started] == ["policy", "generation", "environments"]
        assert set(seconds) == {"policy", "generation", "environments"} and shut == []
    assert shut == ["environments", "generation", "policy"]  # last started, first shut down


def test_a_failing_part_waits_for_the_others_shuts_them_down_and_raises_its_error():
    shut: list[str] = []
    slow_done = threading.Event()

    def slow():
        slow_done.wait(0.5)
        return Part("slow", shut)

    def failing():
        raise ValueError("policy.optimizer.lr must be positive")

    with pytest.raises(ValueError, match="policy.optimizer.lr must be positive"), contextlib.ExitStack() as cleanup:
        startup = Startup(cleanup)
        startup.start("slow", slow)
        startup.start("policy", failing)
        startup.wait()
    assert shut == ["slow"]


def test_a_stop_during_start_up_returns_at_once_and_a_part_still_starting_shuts_itself_down():
    shut: list[str] = []
    release = threading.Event()
    self_shut = threading.Event()

    def quick():
        return Part("quick", shut)

    def stuck():  # a worker group still starting when the signal comes
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(10)
        return Part("stuck", shut)

    def shutdown_and_tell(part):
        part.shutdown()
        self_shut.set()

    stop = StopRequest()
    with stop_on_signals(stop), pytest.raises(StartupInterrupted), contextlib.ExitStack() as cleanup:
        startup = Startup(cleanup, stop.check_startup)
        quick_part = startup.start("quick", quick)
        quick_part.done.wait(10)
        startup.start("stuck", stuck, shutdown_and_tell)
        startup.wait()
    assert shut == ["quick"]  # shut down by cleanup; the stuck part is still building
    release.set()
    assert self_shut.wait(10) and shut == ["quick", "stuck"]
