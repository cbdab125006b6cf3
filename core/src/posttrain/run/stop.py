"""Stopping a run on SIGINT / SIGTERM: as soon as possible during start-up, at a step
boundary after.

:func:`stop_on_signals` installs handlers for the length of a run. The first signal only
sets :class:`StopRequest`; nothing is raised from the handler (an exception raised at an
arbitrary point can leave a lock held or be swallowed by library code). What follows
depends on the run's phase:

- during start-up (before :meth:`StopRequest.begin_steps`: data, Ray, workers, restoring a
  checkpoint), nothing is trained and nothing can be saved: the start-up checks the request
  between its stages and while it waits for workers (:meth:`StopRequest.check_startup`) and
  raises :class:`StartupInterrupted`; what started is shut down and no further worker starts.
  A stage that cannot be interrupted (Ray's own start, a checkpoint being restored) is
  finished first;
- once the steps began, training loops poll :attr:`StopRequest.requested` between steps, so
  the step (or validation) in flight completes and is checkpointed, or (when the signal came
  before it started) never runs. A half-applied step is never saved.

A second signal gives up on the clean stop and raises :class:`KeyboardInterrupt` at once (no
checkpoint).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

from posttrain.errors import RunStopped
from posttrain.log import get_logger

#: The signals a run stops on: Ctrl-C and what schedulers (Slurm, Kubernetes) send first.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set once a stop signal arrived; read by the loops between steps. ``stepping`` is false
    while the run starts up and true from :meth:`begin_steps` on."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stepping = False

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

    def begin_steps(self) -> None:
        """Start-up is over: from now on a stop signal finishes the step in flight and saves
        (a training loop calls this before its first validation or step)."""
        self.stepping = True

    def check_startup(self) -> None:
        """Raise :class:`StartupInterrupted` when a stop was requested during start-up; a
        no-op otherwise (and once the steps began)."""
        if self.signum is not None and not self.stepping:
            raise StartupInterrupted(self.signum)


class StartupInterrupted(KeyboardInterrupt):
    """Raised by :meth:`StopRequest.check_startup` after a stop signal during start-up (a
    :class:`KeyboardInterrupt`, so no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} during start-up")
        self.signum = signum


class StoppedDuringStartup(RunStopped):
    """A run stopped by a signal before its first step: nothing trained, nothing saved."""

    def __init__(self, signal_name: str, exit_code: int, checkpoint: str | None):
        super().__init__(signal_name, exit_code, 0, checkpoint)
        again = f"resumes from the checkpoint {checkpoint}" if checkpoint else "starts from the beginning"
        self.args = (
            f"stopped by {signal_name} during start-up, before the first step; nothing was trained or saved. "
            f"The run {again} when started again",
        )


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Route ``signals`` to ``stop`` while the block runs (see the module docstring), then
    restore the previous handlers.

    Off the main thread (where Python cannot install handlers) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.requested:
            raise KeyboardInterrupt(f"second stop signal ({name}): stopping without a checkpoint")
        stop.request(signum)
        if not stop.stepping:
            get_logger().warning(
                "stop requested during start-up: no step has run; stopping what has started, no further worker starts",
                signal=name,
            )
            return
        get_logger().warning(
            "stop requested: finishing the current step, then saving a checkpoint; send the signal again to stop at once",
            signal=name,
        )

    previous = {sig: signal.signal(sig, handle) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
