"""Starting a run's parts (policy workers, generation engines, environment actors, the data
plane) at the same time instead of one after another.

Each part is built in a thread of its own (never Ray's own start: Ray ties its processes to
the thread that started it); Ray starts their actors concurrently and the
driver waits for all of them at once, so the start-up takes about as long as the slowest
part instead of the sum. Each part's shutdown goes on the run's ``cleanup`` stack when it is
started, so whatever ends the run (the run's end, a part that failed, a stop signal during
start-up, which :meth:`Startup.wait` raises) shuts every part down once: a part already built
is shut down by ``cleanup``; a part still being built is marked abandoned and shuts itself
down as soon as its builder returns, so the stop does not wait for it.

:meth:`Startup.settle` gives the threads of abandoned parts a moment to end once their
actors were killed (the run's placement groups removed): Ray must not be shut down while a
thread is in the middle of submitting to it (Ray ends the process then). A thread blocked in
a wait on Ray is safe (shutting Ray down ends the wait), so settling stops as soon as every
thread left is either done or in such a wait.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from posttrain.log import get_logger

T = TypeVar("T")

#: Seconds between two checks of the stop request while :meth:`Startup.wait` waits.
POLL_S = 0.05


class Started(Generic[T]):
    """One part being built; :attr:`value` once :meth:`Startup.wait` returned."""

    def __init__(self, name: str, build: Callable[[], T], shutdown: Callable[[T], None]):
        self.name = name
        self.seconds = 0.0
        self.done = threading.Event()
        self._build = build
        self._shutdown = shutdown
        self._value: T | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._thread: threading.Thread | None = None

    @property
    def value(self) -> T:
        """The built part (raises if it was not built)."""
        if self._error is not None or not self.done.is_set():
            raise RuntimeError(f"part '{self.name}' was not started") from self._error
        return self._value  # type: ignore[return-value]

    def wait_value(self, check: Callable[[], None] = lambda: None) -> T:
        """The built part, once it is built (for a part that needs another: e.g. engines
        inside the policy's workers); ``check()`` runs every :data:`POLL_S` seconds meanwhile."""
        while not self.done.wait(POLL_S):
            check()
        return self.value


class Startup:
    """Builds parts concurrently (see the module docstring); ``cleanup`` shuts them down."""

    def __init__(self, cleanup: contextlib.ExitStack, check: Callable[[], None] = lambda: None):
        self._cleanup = cleanup
        self._check = check
        self._parts: list[Started[Any]] = []
        self._lock = threading.Lock()
        self._began = time.perf_counter()

    def start(self, name: str, build: Callable[[], T], shutdown: Callable[[T], None] | None = None) -> Started[T]:
        """Begin ``build()`` in a thread of its own; ``shutdown(part)`` stops what it built
        (by default the part's own ``shutdown()`` method, whatever its class)."""
        part: Started[T] = Started(name, build, shutdown or _own_shutdown)
        self._parts.append(part)
        self._cleanup.callback(self._stop, part)
        part._thread = threading.Thread(target=self._run, args=(part,), name=f"posttrain-start-{name}", daemon=True)
        part._thread.start()
        return part

    def wait(self) -> dict[str, float]:
        """Wait for every part; return the seconds each took, by name, and log them. Raises
        the first failure once every part finished. ``check()`` runs every
        :data:`POLL_S` seconds meanwhile; what it raises (a stop requested during start-up)
        ends the wait at once."""
        for part in self._parts:
            while not part.done.wait(POLL_S):
                self._check()
        failures = [part._error for part in self._parts if part._error is not None]
        if failures:
            raise failures[0]
        seconds = {part.name: round(part.seconds, 2) for part in self._parts}
        get_logger().info("workers started", seconds=round(time.perf_counter() - self._began, 2), **seconds)
        return seconds

    def settle(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s`` seconds, until the thread of every part still starting
        has ended or waits on Ray (:func:`waiting_on_ray`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            starting = [part for part in self._parts if not part.done.is_set()]
            if all(part._thread is not None and waiting_on_ray(part._thread) for part in starting):
                return
            time.sleep(POLL_S)

    def _run(self, part: Started[Any]) -> None:
        start = time.perf_counter()
        try:
            value = part._build()
        except BaseException as error:
            with self._lock:
                part._error = error
                part.done.set()
            return
        with self._lock:
            part._value, part.seconds = value, time.perf_counter() - start
            part.done.set()
            abandoned = part._abandoned
        if abandoned:  # the run ended while this part was starting: nobody else will stop it
            with contextlib.suppress(Exception):
                part._shutdown(value)

    def _stop(self, part: Started[Any]) -> None:
        """``cleanup``'s callback: shut ``part`` down if it was built, else leave that to its
        thread."""
        with self._lock:
            built = part.done.is_set() and part._error is None
            part._abandoned = not part.done.is_set()
        if built:
            part._shutdown(part._value)


def _own_shutdown(part: Any) -> None:
    part.shutdown()


#: The functions of Ray's driver API (``ray/_private/worker.py``) in which a thread blocks,
#: in C, until objects are ready: ``ray.get`` and ``ray.wait``.
_RAY_WAITS = frozenset({"get_objects", "wait"})


def waiting_on_ray(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in ``ray.get`` or ``ray.wait`` now (its innermost Python
    frame is Ray's), where shutting Ray down wakes it with an error instead of ending the
    process. False when unsure."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return False
    code = frame.f_code
    return code.co_name in _RAY_WAITS and Path(code.co_filename).parts[-3:] == ("ray", "_private", "worker.py")
