"""A small process pool whose every job has a deadline, for environments that run code they
do not control: a verifier (math-verify can run for minutes on ``\\boxed{99999999!}``, and
its own time limits use ``signal.alarm``, which only works on a process's main thread), a
tool the model calls. This pool runs jobs in separate worker processes: a job still running
``timeout_s`` seconds after it was handed to a worker is given up, that worker is killed and
a fresh one started. A job whose worker process died under it (killed from outside, out of
memory) runs once more on a fresh worker; a second death is the job's error. It works from
any thread (Ray actors, thread pools).

Workers are fresh interpreters (``python -m posttrain.deadline_pool``) that import
only the job function's module, never the parent's ``__main__`` (unlike multiprocessing's
``spawn``), and talk to the parent over a socket pair. A worker exits when the parent
closes its end or disappears; one stuck inside a long C call when the parent is killed
finishes that call first.
"""

from __future__ import annotations

import collections
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs


@attrs.frozen
class JobResult:
    """What became of one job: ``status`` is ``"ok"`` (``value`` holds the return value),
    ``"timeout"`` or ``"error"`` (``error`` says what happened)."""

    status: str
    value: Any = None
    error: str = ""
    worker_died: bool = False  # the job's worker process died under it


class DeadlinePool:
    """Run ``fn(*args)`` for many argument tuples in ``num_workers`` processes.

    ``fn`` must be a module-level function; workers import it by name. The constructor
    returns once every worker has started (so start-up never counts against a job's
    deadline; a worker replaced later starts while the others work). Calls to :meth:`map`
    must not overlap (one thread at a time).
    """

    def __init__(self, fn: Callable[..., Any], *, num_workers: int, timeout_s: float, start_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._target = f"{fn.__module__}:{fn.__qualname__}"
        self._timeout_s = timeout_s
        self._start_timeout_s = start_timeout_s
        self._workers = [self._start_worker() for _ in range(num_workers)]
        try:
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    def map(self, jobs: Sequence[tuple[Any, ...]]) -> list[JobResult]:
        """Run every job; return one :class:`JobResult` per job, in order."""
        results = [JobResult("error", error="not run")] * len(jobs)
        queue = collections.deque(range(len(jobs)))
        died: set[int] = set()  # jobs whose worker died under them once
        try:
            while queue or any(w.job is not None for w in self._workers):
                for worker in self._workers:
                    if worker.ready and worker.job is None and queue:
                        worker.assign(queue.popleft(), jobs)
                next_deadline = min(self._deadline(w) for w in self._workers)
                wait([w.conn for w in self._workers], timeout=max(0.0, next_deadline - time.monotonic()))
                for i, worker in enumerate(self._workers):
                    job, result, healthy = self._check(worker)
                    if job is not None and result is not None:
                        if result.worker_died and job not in died:
                            died.add(job)
                            queue.appendleft(job)  # once more, on the fresh worker started below
                        else:
                            results[job] = result
                    if not healthy:
                        worker.kill()
                        self._workers[i] = self._start_worker()
        except BaseException:
            num_workers = len(self._workers)
            self.close()  # no worker may keep a job of this call
            self._workers = [self._start_worker() for _ in range(num_workers)]
            raise
        return results

    def close(self) -> None:
        """Stop every worker. Safe to call twice."""
        for worker in self._workers:
            worker.stop()
        self._workers = []

    # ------------------------------------------------------------------ internals

    def _start_worker(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}  # as the parent
        command = [sys.executable, "-m", __name__, str(child_sock.fileno()), self._target, str(os.getpid())]
        process = subprocess.Popen(command, pass_fds=[child_sock.fileno()], env=env, stdin=subprocess.DEVNULL)
        child_sock.close()
        return _Worker(process, Connection(parent_sock.detach()), started=time.monotonic())

    def _wait_until_ready(self) -> None:
        """Return when every worker has started; raise if one dies or takes too long."""
        while pending := [w for w in self._workers if not w.ready]:
            wait([w.conn for w in pending], timeout=max(0.0, min(self._deadline(w) for w in pending) - time.monotonic()))
            for worker in pending:
                self._check(worker)

    def _deadline(self, worker: _Worker) -> float:
        if not worker.ready:
            return worker.started + self._start_timeout_s
        if worker.job is not None:
            return worker.started + self._timeout_s
        return float("inf")

    def _check(self, worker: _Worker) -> tuple[int | None, JobResult | None, bool]:
        """``(job, result, healthy)``: the job ``worker`` finished or gave up on (if any),
        and whether the worker can be kept. Marks a freshly started worker ready."""
        if worker.conn.poll():
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):  # the process died
                message = None
            if message == _READY:
                worker.ready = True
                return None, None, True
            if message is not None:
                job, status, payload = message
                worker.job = None
                return job, JobResult("ok", value=payload) if status == "ok" else JobResult("error", error=payload), True
            self._require_started(worker)
            why = f"the worker process died (exit code {worker.exit_code()})"
            return worker.take_job(), JobResult("error", error=why, worker_died=True), False
        if time.monotonic() >= self._deadline(worker):
            self._require_started(worker)
            why = f"did not finish within {self._timeout_s:g} s"
            return worker.take_job(), JobResult("timeout", error=why), False
        return None, None, True

    def _require_started(self, worker: _Worker) -> None:
        if not worker.ready:
            raise RuntimeError(
                f"a worker process for {self._target} did not start within {self._start_timeout_s:g} s "
                f"or died while starting (exit code {worker.exit_code()}); its error is on stderr"
            )


@attrs.define
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started: float  # when it was spawned (not ready) or got its job (ready)
    ready: bool = False
    job: int | None = None

    def assign(self, job: int, jobs: Sequence[tuple[Any, ...]]) -> None:
        self.conn.send((job, jobs[job]))
        self.job = job
        self.started = time.monotonic()

    def take_job(self) -> int | None:
        job, self.job = self.job, None
        return job

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Ask an idle worker to exit; kill a busy (possibly stuck) one."""
        if self.process.poll() is None and self.job is None:
            try:
                self.conn.send(None)
                self.process.wait(timeout=1.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


_READY = "ready"


def _serve(conn: Connection, fn: Callable[..., Any], parent_pid: int) -> None:
    """Worker loop: answer ``(job, args)`` messages with ``(job, status, payload)`` until
    ``None`` arrives, the connection closes or the parent process goes away."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        conn.send(_READY)
        while (message := conn.recv()) is not None:
            job, args = message
            try:
                reply = (job, "ok", fn(*args))
            except Exception as exc:  # reported to the parent as this job's error
                reply = (job, "error", f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    except (EOFError, OSError):  # the parent closed the pool
        return


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _worker_main(fd: str, target: str, parent_pid: str) -> None:
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    _serve(Connection(int(fd)), fn, int(parent_pid))


if __name__ == "__main__":
    _worker_main(*sys.argv[1:])
