"""Run untrusted Python in a confined, short-lived process.

:class:`Sandbox` runs a program (and optionally test snippets against it) in a separate
process with a wall-clock deadline, CPU-time, address-space, process-count, file-size and
open-file limits, an output cap, a clean environment and ``python -I``. On Linux it adds
namespaces (no network, read-only filesystem except a fresh tmpfs work folder, own PID
space) and, as root, a fresh unprivileged uid per run. An audit hook in the program's
interpreter refuses process creation, sockets, native code and writes outside the work
folder: defence in depth, not a boundary. ``docs/sandbox.md`` says what each mechanism
guarantees and what none of them does.

Every run is killed as a whole process group when it ends, times out or floods its output,
and its work folder is removed.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import attrs

from posttrain.errors import PosttrainError
from posttrain.log import get_logger
from posttrain_env_code import _isolate

_log = get_logger(__name__)

#: Folders hidden behind empty read-only tmpfs mounts in the namespace: shared scratch
#: space and runtime sockets of other programs.
DEFAULT_HIDE = ("/tmp", "/var/tmp", "/dev/shm", "/run")

_ISOLATE = str(Path(_isolate.__file__).resolve())
_HARNESS_SOURCE = (Path(__file__).parent / "_harness.py").read_text()
# Reads the configuration from the descriptor in argv[1] and runs the harness with it.
_BOOT = (
    "import json,os,sys\n"
    "f=os.fdopen(int(sys.argv[1]),'rb');c=json.loads(f.read());f.close()\n"
    "exec(compile(c.pop('harness'),'<sandbox harness>','exec'),{'__name__':'__sandbox__','CONFIG':c})"
)
_RESULT_CAP = 1 << 20  # bytes of result-channel data read per run
_MAX_UID = 2**31 - 2
_DRAIN_S = 0.2  # how long to keep reading after the kill (writers are dead: EOF comes at once)


class SandboxError(PosttrainError):
    """The sandbox itself failed (setup, not the program): the run says nothing about the code."""


@attrs.frozen
class SandboxLimits:
    """Per-run limits. Memory is address space per process (``RLIMIT_AS``); disk is the
    work folder's size (and the largest file)."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # stdout and stderr together
    max_processes: int = 16  # processes and threads of the sandbox uid (RLIMIT_NPROC)
    disk_mb: int = 16
    max_open_files: int = 64


@attrs.frozen
class TestOutcome:
    """One test snippet: ``status`` is ``ok`` (passed), ``error``, ``exit`` or ``memory``."""

    __test__ = False  # not a pytest test class, whatever its name

    index: int
    status: str
    error: str | None

    @property
    def passed(self) -> bool:
        return self.status == "ok"


@attrs.frozen
class RunResult:
    """What became of one run.

    ``exit_code`` is None when the process was killed by a signal (``killed_by_signal``).
    ``timed_out``: stopped at the wall-clock deadline or by the CPU-time limit.
    ``memory_exceeded``: the program or a test ran out of its address space.
    ``solution_status``/``solution_error``: how the program itself ended (``ok``, ``error``,
    ``exit``, ``memory``), None when it never reported (killed first). ``tests``: the
    outcome of each test snippet the run finished, in order.
    """

    exit_code: int | None
    killed_by_signal: int | None
    stdout: str
    stderr: str
    timed_out: bool
    memory_exceeded: bool
    output_truncated: bool
    duration_s: float
    solution_status: str | None
    solution_error: str | None
    tests: tuple[TestOutcome, ...]
    isolation: tuple[str, ...]

    @property
    def tests_passed(self) -> int:
        return sum(test.passed for test in self.tests)


class Sandbox:
    """Runs programs under ``limits``; safe to call :meth:`run` from several threads.

    ``namespaces``: ``"auto"`` uses Linux namespaces when they work here (checked once, by a
    probe run, in the constructor) and warns when they do not; ``"require"`` raises
    :class:`SandboxError` instead; ``"off"`` never uses them. ``audit_hook=False`` leaves
    the kernel mechanisms alone in charge (for testing them). ``hide``: folders covered by
    an empty tmpfs inside the namespace. ``tmp_root``: where work folders are created.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        namespaces: Literal["auto", "require", "off"] = "auto",
        audit_hook: bool = True,
        hide: Sequence[str] = DEFAULT_HIDE,
        tmp_root: str | None = None,
        python: str = sys.executable,
    ):
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"the code sandbox needs Linux (prctl, rlimits, namespaces); this is {sys.platform}")
        if namespaces not in ("auto", "require", "off"):
            raise ValueError(f"namespaces must be 'auto', 'require' or 'off', got {namespaces!r}")
        self.limits = limits or SandboxLimits()
        self.audit_hook = audit_hook
        self.hide = tuple(hide)
        self.tmp_root = tmp_root
        self.python = python
        # Paths the interpreter needs; made reachable for the sandbox uid inside the namespace.
        self._expose = sorted({sys.base_prefix, sys.prefix, str(Path(python).resolve().parent)})
        self._namespaces = namespaces != "off"
        try:
            self.isolation = self._probe()
        except SandboxError as exc:
            if namespaces != "auto":
                raise
            self._namespaces = False
            self.isolation = self._probe()
            _log.warning(
                "sandbox: Linux namespaces are unavailable; programs get no network or filesystem isolation "
                "beyond the audit hook (see docs/sandbox.md)",
                error=str(exc),
                isolation=self.isolation,
                runs_as_root=os.geteuid() == 0 and not self._unprivileged,
            )

    @property
    def _unprivileged(self) -> bool:
        """Whether runs get a fresh uid: as root, when the sandbox uid can reach the
        interpreter (a mount namespace makes it reachable; without one it must already be)."""
        if os.geteuid() != 0:
            return False
        return self._namespaces or all(_isolate.blocked_ancestor(p) is None for p in self._expose)

    def _probe(self) -> tuple[str, ...]:
        result = self.run("pass")
        if result.exit_code != 0:
            raise SandboxError(
                f"the sandbox's probe run failed (exit {result.exit_code}): {result.stderr.strip()[-2000:]}"
            )
        return result.isolation

    def run(
        self,
        source: str,
        *,
        stdin: str = "",
        tests: Sequence[str] | None = None,
        as_main: bool | None = None,
    ) -> RunResult:
        """Run ``source`` (then each of ``tests``, Python snippets executed in the program's
        namespace) and return what happened. The program runs as module ``__main__`` when
        ``as_main`` (default: when there are no tests), else as module ``solution``.
        Raises :class:`SandboxError` only when the sandbox could not be set up."""
        nonce = secrets.token_hex(16)
        uid = secrets.randbelow(_MAX_UID - 2**30) + 2**30 if self._unprivileged else None
        run_dir = tempfile.mkdtemp(prefix="posttrain-sandbox-", dir=self.tmp_root)
        try:
            if uid is not None:
                os.chown(run_dir, uid, uid)  # the work folder itself when there is no namespace
            config = {
                "harness": _HARNESS_SOURCE,
                "nonce": nonce,
                "workdir": run_dir,
                "source": source,
                "tests": None if tests is None else list(tests),
                "module_name": "__main__" if (tests is None if as_main is None else as_main) else "solution",
                "audit_hook": self.audit_hook,
            }
            with tempfile.TemporaryFile() as config_file, tempfile.TemporaryFile() as stdin_file:
                stdin_file.write(stdin.encode())
                stdin_file.seek(0)
                return self._execute(config, config_file, stdin_file, uid)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _execute(self, config: dict, config_file, stdin_file, uid: int | None) -> RunResult:
        limits = self.limits
        result_r, result_w = os.pipe()
        config["result_fd"] = result_w
        config_file.write(json.dumps(config).encode())
        config_file.seek(0)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": config["workdir"],
            "TMPDIR": config["workdir"],
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }
        spec = {
            "parent_pid": os.getpid(),
            "python": self.python,
            "workdir": config["workdir"],
            "namespaces": self._namespaces,
            "uid": uid,
            "expose": self._expose,
            "hide": list(self.hide),
            "limits": {
                "cpu_s": math.ceil(limits.timeout_s) + 1,
                "memory_bytes": limits.memory_mb << 20,
                "file_bytes": limits.disk_mb << 20,
                "open_files": limits.max_open_files,
                "processes": limits.max_processes,
            },
            "config_fd": config_file.fileno(),
            "result_fd": result_w,
            "boot": _BOOT,
            "env": env,
        }
        start = time.monotonic()
        try:
            process = subprocess.Popen(
                [self.python, "-I", "-S", _ISOLATE, json.dumps(spec)],
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(config_file.fileno(), result_w),
                env=env,
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            os.close(result_r)
            raise
        finally:
            os.close(result_w)
        reader = _Reader(process, result_r, limits.max_output_bytes)
        try:
            _collect(process, reader, deadline=start + limits.timeout_s)
            duration = time.monotonic() - start
        finally:
            _kill_group(process)
            reader.pump(time.monotonic() + _DRAIN_S)  # what was written before the kill
            reader.close()
            process.stdout.close()
            process.stderr.close()
            os.close(result_r)
        return _result(process.returncode, reader, config["nonce"], duration)


class _Reader:
    """Reads a run's stdout and stderr (together capped at ``cap`` bytes) and its result
    channel (capped at :data:`_RESULT_CAP`) as data arrives."""

    def __init__(self, process: subprocess.Popen, result_fd: int, cap: int):
        self.stdout, self.stderr, self.result = bytearray(), bytearray(), bytearray()
        self.cap = cap
        self.result_fd = result_fd
        self.timed_out = self.truncated = False
        self._buffers = {
            process.stdout.fileno(): self.stdout,
            process.stderr.fileno(): self.stderr,
            result_fd: self.result,
        }
        self._selector = selectors.DefaultSelector()
        for fd in self._buffers:
            self._selector.register(fd, selectors.EVENT_READ)

    def pump(self, deadline: float) -> str:
        """Read until every stream is closed (``"eof"``), ``deadline`` passes (``"deadline"``)
        or the output goes over the cap (``"cap"``)."""
        while self._selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "deadline"
            for key, _ in self._selector.select(remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    self._selector.unregister(key.fd)
                    continue
                buffer = self._buffers[key.fd]
                if key.fd == self.result_fd:
                    buffer += data[: max(0, _RESULT_CAP - len(buffer))]
                    continue
                room = max(0, self.cap - len(self.stdout) - len(self.stderr))
                buffer += data[:room]
                if len(data) > room:
                    self.truncated = True
                    return "cap"
        return "eof"

    def close(self) -> None:
        self._selector.close()


def _collect(process: subprocess.Popen, reader: _Reader, deadline: float) -> None:
    """Read the run's output until the process has exited, the deadline passes or the output
    overflows; the process is left unreaped (so its process group stays addressable)."""
    stopped = reader.pump(deadline)
    if stopped == "deadline":
        reader.timed_out = True
    if stopped != "eof":
        return
    # Every writer closed its ends; wait (without reaping) for the process to exit.
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() >= deadline:
            reader.timed_out = True
            return
        time.sleep(0.002)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (the leader is not reaped yet, so the group id
    cannot have been reused), then reap the leader. With namespaces, the leader's death
    kills the namespace's PID 1 (parent-death signal) and with it every process inside."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _result(returncode: int, streams: _Reader, nonce: str, duration: float) -> RunResult:
    header: dict = {}  # stage 1's records: whatever comes before the harness says "started"
    events = []
    for record in map(_json_object, bytes(streams.result).decode("utf-8", "replace").splitlines()):
        if record is None:
            continue
        if record.get("nonce") == nonce:
            events.append(record)
        elif not events:
            header.update(record)
    if "setup_error" in header:
        raise SandboxError(f"sandbox setup failed: {header['setup_error']}")
    if returncode == _isolate.SETUP_FAILED and not events:
        raise SandboxError(
            f"sandbox setup failed (exit {returncode}): {bytes(streams.stderr).decode('utf-8', 'replace')[-2000:]}"
        )
    solution = next((e for e in events if e.get("event") == "solution"), None)
    tests: dict[int, TestOutcome] = {}
    for event in events:
        if event.get("event") == "test" and isinstance(event.get("index"), int) and event["index"] not in tests:
            tests[event["index"]] = TestOutcome(event["index"], str(event.get("status")), event.get("error"))
    signal_number = -returncode if returncode < 0 else None
    return RunResult(
        exit_code=None if returncode < 0 else returncode,
        killed_by_signal=signal_number,
        stdout=bytes(streams.stdout).decode("utf-8", "replace"),
        stderr=bytes(streams.stderr).decode("utf-8", "replace"),
        timed_out=streams.timed_out or signal_number == signal.SIGXCPU,
        memory_exceeded=any(e.get("event") == "memory" or e.get("status") == "memory" for e in events),
        output_truncated=streams.truncated,
        duration_s=duration,
        solution_status=None if solution is None else str(solution.get("status")),
        solution_error=None if solution is None else solution.get("error"),
        tests=tuple(tests[i] for i in sorted(tests)),
        isolation=tuple(header.get("isolation", ())),
    )


def _json_object(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
