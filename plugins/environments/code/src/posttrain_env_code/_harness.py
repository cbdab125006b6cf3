"""Stage 2 of a sandbox run: the guard, the program and its tests, inside the confined process.

Not imported: :mod:`posttrain_env_code.sandbox` sends this file's source with the run's
configuration to ``python -I -c BOOT``, which executes it with ``CONFIG`` bound to that
configuration (keys ``nonce``, ``result_fd``, ``workdir``, ``source``, ``module_name``,
``tests`` and ``audit_hook``).

It installs the audit hook (defence in depth: the kernel mechanisms of stage 1 are the
boundary), runs the program as module ``module_name`` (file name ``solution.py``), then,
if the program ran to its end without raising (SystemExit included), each test snippet in
the program's namespace. Results go to the result channel as JSON
lines carrying the run's nonce: ``{"event": "started"}``, ``{"event": "solution", "status", "error"}``, one
``{"event": "test", "index", "status", "error"}`` per test, then ``{"event": "done"}``.
``status`` is ``ok``, ``error``, ``exit`` (SystemExit) or ``memory`` (MemoryError; also
announced first by a bare ``{"event": "memory"}``, written before anything is freed; no
test runs after one).

Without tests the process exits like ``python solution.py`` would: 0, the SystemExit
code, or 1 after an uncaught exception (traceback on stderr).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

# Events refused outright: new processes, signals to other processes, the network (creating
# a socket object is allowed: asyncio makes socket pairs), native code, resource limits.
_REFUSED_PREFIXES = (
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.kill",
    "os.killpg",
    "subprocess.",
    "pty.",
    "socket.",
    "ctypes.",
    "resource.setrlimit",
    "resource.prlimit",
)
_ALLOWED = frozenset({"socket.__new__"})
# Imported before the hook (numpy needs ctypes; importing ctypes loads libraries), so that
# later imports find them loaded; a fresh import of either is refused.
_PRELOADED = ("ctypes", "_posixsubprocess")
# Events that modify a path: the positions of the paths modified, and of dir_fd arguments.
_PATH_EVENTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "os.remove": ((0,), (1,)),
    "os.rmdir": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.mkdir": ((0,), (2,)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.link": ((1,), (2, 3)),
    "os.symlink": ((1,), (2,)),
    "os.truncate": ((0,), ()),
    "os.utime": ((0,), (3,)),
    "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def make_guard(workdir: str) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook: raise PermissionError for anything the sandbox refuses."""
    root = os.path.realpath(workdir)

    def inside(path: Any) -> bool:
        if isinstance(path, int):  # an already open descriptor
            return True
        resolved = os.path.realpath(os.fsdecode(path))
        return resolved == root or resolved.startswith(root + os.sep)

    def refuse(event: str, detail: str = "") -> None:
        raise PermissionError(f"sandbox: {event} is not allowed{detail}")

    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(_REFUSED_PREFIXES) and event not in _ALLOWED:
            refuse(event)
        if event == "import" and args[0] in _PRELOADED:
            refuse(event, f" for module {args[0]!r}")
        if event == "open":
            path, mode, flags = args
            writing = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            if writing and path is not None and not inside(path):
                refuse("writing", f" outside the sandbox folder: {path!r}")
        elif event == "sqlite3.connect":
            if args[0] not in (":memory:", "", b":memory:", b"") and not inside(args[0]):
                refuse(event, f" outside the sandbox folder: {args[0]!r}")
        elif event in _PATH_EVENTS:
            paths, dir_fds = _PATH_EVENTS[event]
            if any(len(args) > i and args[i] not in (None, -1) for i in dir_fds):
                refuse(event, " with dir_fd")
            for i in paths:
                if not inside(args[i]):
                    refuse(event, f" outside the sandbox folder: {args[i]!r}")

    return guard


def _refuse_fork_exec(*args: Any) -> None:
    raise PermissionError("sandbox: starting a process is not allowed")


def run_code(
    code: types.CodeType, namespace: dict[str, Any], memory_record: bytes, result_fd: int
) -> tuple[str, str | None, int]:
    """Execute ``code``: ``(status, error, exit status python would give)``, as in the module
    docstring. Failures other than a clean SystemExit print their traceback to stderr.

    On MemoryError the memory is probably still held (by the namespace), so nothing that
    allocates comes first: the pre-encoded ``memory_record`` goes to the result channel,
    then the namespace is emptied to free what it held.
    """
    try:
        exec(code, namespace)
        return "ok", None, 0
    except MemoryError:
        _write(result_fd, memory_record)
        namespace.clear()
        _write(2, b"MemoryError\n")
        return "memory", "MemoryError", 1
    except BaseException as exc:  # the program's own failure, reported as data
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return "exit", None, 0
        try:
            traceback.print_exception(exc)
        except MemoryError:
            pass
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, SystemExit):
            return "exit", f"SystemExit({exc.code!r})", exc.code if isinstance(exc.code, int) else 1
        return "error", error, 1


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:  # closed or full: nothing more to do
        pass


def main(config: dict[str, Any]) -> None:
    nonce, result_fd = config["nonce"], config["result_fd"]

    def report(**record: Any) -> None:
        _write(result_fd, (json.dumps({"nonce": nonce, **record}) + "\n").encode())

    memory_record = (json.dumps({"nonce": nonce, "event": "memory"}) + "\n").encode()

    report(event="started")  # from here on, only records with the nonce count
    if config["audit_hook"]:
        import _posixsubprocess
        import ctypes  # noqa: F401  # (see _PRELOADED)

        _posixsubprocess.fork_exec = _refuse_fork_exec  # it raises no audit event of its own
        sys.addaudithook(make_guard(config["workdir"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit raises instead
    name = config["module_name"]
    module = types.ModuleType(name)
    module.__file__ = os.path.join(config["workdir"], "solution.py")
    sys.modules[name] = module
    sys.argv = ["solution.py"]
    try:
        code = compile(config["source"], "solution.py", "exec")
        status, error, code_of_exit = run_code(code, module.__dict__, memory_record, result_fd)
    except (SyntaxError, ValueError) as exc:  # ValueError: the source holds a NUL byte
        status, error, code_of_exit = "error", f"{type(exc).__name__}: {exc}", 1
        print(error, file=sys.stderr)
    report(event="solution", status=status, error=error)
    tests = config["tests"]
    if tests is None:
        _finish(code_of_exit)
    if status != "ok":  # tests of a program that did not run to its end all fail
        tests = []
    for index, test in enumerate(tests):
        try:
            code = compile(test, f"test_{index}", "exec")
        except (SyntaxError, ValueError) as exc:
            report(
                event="test",
                index=index,
                status="error",
                error=f"the test does not compile: {type(exc).__name__}: {exc}",
            )
            continue
        test_status, test_error, _ = run_code(code, module.__dict__, memory_record, result_fd)
        report(event="test", index=index, status=test_status, error=test_error)
        if test_status == "memory":  # the namespace is gone: later tests cannot run
            break
    report(event="done")
    _finish(0)


def _finish(code: int) -> None:
    """Flush the program's output and exit now (no atexit handlers, no waiting for threads)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more can be written to it
            pass
    os._exit(code)


if __name__ == "__sandbox__":
    main(CONFIG)  # type: ignore[name-defined]  # noqa: F821
