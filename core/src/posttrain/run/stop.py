"""Graceful stop on SIGINT / SIGTERM: finish the current step, save, exit.

:func:`stop_on_signals` installs handlers for the length of a run. The first signal only
sets :class:`StopRequest`; training loops poll :attr:`StopRequest.requested` between steps,
so the step in flight either completes and is checkpointed, or (when the signal came
before it started) never runs. A half-applied step is never saved. A second signal gives
up on the clean stop and raises :class:`KeyboardInterrupt` at once (no checkpoint).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

from posttrain.log import get_logger

#: The signals a run stops on: Ctrl-C and what schedulers (Slurm, Kubernetes) send first.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set once a stop signal arrived; read by the loops between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def request(self, signum: int) -> None:
        """Ask the run to stop at the next step boundary (what the first signal does)."""
        if self.signum is None:
            self.signum = signum


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Route ``signals`` to ``stop`` while the block runs, then restore the previous handlers.

    Off the main thread (where Python cannot install handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        if stop.requested:
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(signum).name}): stopping without a checkpoint")
        stop.request(signum)
        get_logger().warning(
            "stop requested: finishing the current step, then saving a checkpoint; send the signal again to stop at once",
            signal=signal.Signals(signum).name,
        )

    previous = {sig: signal.signal(sig, handle) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
