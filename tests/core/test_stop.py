"""SIGINT / SIGTERM during a run: the first only requests a stop, the second aborts, and the
previous handlers come back afterwards."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from posttrain.run.stop import StopRequest, stop_on_signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_requests_a_stop_and_the_second_aborts(signum):
    stop = StopRequest()
    with stop_on_signals(stop):
        os.kill(os.getpid(), signum)
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
