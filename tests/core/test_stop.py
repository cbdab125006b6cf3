"""SIGINT / SIGTERM during a run: during start-up the first stops at once; once the steps
began it only requests a stop and the second aborts; the previous handlers come back
afterwards."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from posttrain.run.stop import StartupInterrupted, StoppedDuringStartup, StopRequest, stop_on_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_during_start_up_the_first_signal_ends_the_start_up_at_its_next_check(signum, capsys):
    stop = StopRequest()
    stop.check_startup()  # no signal yet: nothing to do
    with stop_on_signals(stop):
        os.kill(os.getpid(), signum)  # the handler itself raises nothing
        with pytest.raises(StartupInterrupted) as interrupted:
            stop.check_startup()
    assert interrupted.value.signum == signum and stop.signal_name == signum.name
    assert "stop requested during start-up: no step has run; stopping what has started" in "".join(capsys.readouterr())  # stdout or stderr, as logging is set up


def test_a_stop_during_start_up_says_nothing_was_trained_and_where_the_next_run_starts():
    assert str(StoppedDuringStartup("SIGINT", 130, None)) == (
        "stopped by SIGINT during start-up, before the first step; nothing was trained or saved. "
        "The run starts from the beginning when started again"
    )
    stopped = StoppedDuringStartup("SIGTERM", 143, "/runs/x/checkpoints/step_4")
    assert str(stopped) == (
        "stopped by SIGTERM during start-up, before the first step; nothing was trained or saved. "
        "The run resumes from the checkpoint /runs/x/checkpoints/step_4 when started again"
    )
    assert stopped.exit_code == 143


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_once_the_steps_began_the_first_signal_requests_a_stop_and_the_second_aborts(signum, capsys):
    stop = StopRequest()
    stop.begin_steps()
    with stop_on_signals(stop):
        os.kill(os.getpid(), signum)
        stop.check_startup()  # start-up is over: the loop stops at its next step boundary instead
        assert "stop requested: finishing the current step, then saving a checkpoint" in "".join(capsys.readouterr())  # stdout or stderr, as logging is set up
        assert stop.requested and stop.signum == signum and stop.signal_name == signum.name
        with pytest.raises(KeyboardInterrupt, match=f"second stop signal \\({signum.name}\\)"):
            os.kill(os.getpid(), signum)
    assert stop.signum == signum  # the second signal does not overwrite the first


def test_previous_handlers_are_restored():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with stop_on_signals(StopRequest()):
            assert signal.getsignal(signal.SIGTERM) is not previous
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_it_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    during = []

    def body():
        with stop_on_signals(StopRequest()):
            during.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert during == [before]
