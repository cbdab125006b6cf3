"""The sandbox refuses what it must (network, writes outside its folder, runaway time, memory,
processes, output) by each of its layers, and runs ordinary programs faithfully.

Layers are tested apart: ``kernel`` runs with the audit hook off (namespaces, rlimits and
the sandbox uid alone), ``hook`` with namespaces off (the audit hook and rlimits alone).
``unprotected`` (neither) is the control showing that the probe programs really connect and
really write when nothing stops them. Every dangerous program runs only inside a sandbox;
every run is killed as a process group when ``run`` returns, whatever happens.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from posttrain_env_code.sandbox import Sandbox, SandboxLimits

TIMEOUT_S = 3.0
SLACK_S = 1.0  # start-up and kill overhead allowed past the deadline
LIMITS = SandboxLimits(timeout_s=TIMEOUT_S, memory_mb=256, max_output_bytes=10_000, max_processes=8)


@pytest.fixture(scope="module")
def sandboxes() -> dict[str, Sandbox]:
    """The default sandbox and each layer alone, built once (each constructor probes)."""
    return {
        "default": Sandbox(LIMITS),
        "kernel": Sandbox(LIMITS, audit_hook=False, hide=()),
        "hook": Sandbox(LIMITS, namespaces="off"),
    }


@pytest.fixture(scope="module")
def unprotected() -> Sandbox:
    return Sandbox(LIMITS, namespaces="off", audit_hook=False)


def needs_namespaces(sandbox: Sandbox) -> None:
    if "namespaces" not in sandbox.isolation:
        pytest.skip(f"Linux namespaces are unavailable here (isolation {sandbox.isolation})")


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, int]]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    try:
        yield server, server.getsockname()[1]
    finally:
        server.close()


def connections(server: socket.socket) -> int:
    """How many connections are waiting on ``server``."""
    count = 0
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            return count
        conn.close()
        count += 1


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder outside any sandbox that every uid may write to (mode 0777 on the way down)."""
    folder = Path(tempfile.mkdtemp(prefix="sandbox-victim-"))
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


def connect_program(port: int) -> str:
    return f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"


def write_program(target: Path) -> str:
    return f"with open({str(target)!r}, 'w') as f:\n    f.write('escaped')\nprint('written')"


def sandbox_processes(programs_only: bool = False) -> list[int]:
    """PIDs of live sandbox processes of this test process: stage-1 launchers and the programs
    they run (the boot code is in their command lines), ours (descendants of this process)
    or left behind by anyone (orphans, adopted by init); ``programs_only``: just the programs
    (``python -I -c BOOT FD`` and their forks). Another pytest process's live sandboxes are
    not ours."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            except OSError:  # exited meanwhile
                continue
            if programs_only:
                ours = len(args) >= 3 and args[-3] == b"-c" and b"<sandbox harness>" in args[-2]
            else:
                ours = any(b"<sandbox harness>" in arg for arg in args)
            if ours and _ours_or_orphaned(int(entry)):
                pids.append(int(entry))
    return pids


def _ours_or_orphaned(pid: int) -> bool:
    """Whether the first ancestor of ``pid`` that is not a sandbox process is this process
    (ours) or init (left behind), rather than another process (another pytest process's)."""
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
            if pid in (os.getpid(), 1):
                return True
            if b"<sandbox harness>" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return False
        except OSError:  # exited meanwhile
            return False


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("layer", ["default", "kernel", "hook"])
def test_a_network_connection_is_refused(sandboxes, layer, listener):
    sandbox = sandboxes[layer]
    if layer == "kernel":
        needs_namespaces(sandbox)
    server, port = listener
    result = sandbox.run(connect_program(port))
    assert "connected" not in result.stdout
    assert result.exit_code == 1 and result.solution_status == "error"
    expected = "Network is unreachable" if layer == "kernel" else "is not allowed"
    assert expected in result.solution_error
    assert connections(server) == 0


def test_control_without_protection_the_connection_is_made(unprotected, listener):
    server, port = listener
    result = unprotected.run(connect_program(port))
    assert result.stdout == "connected\n", result.stderr
    assert connections(server) == 1


@pytest.mark.parametrize("layer", ["default", "kernel", "hook"])
def test_writing_outside_the_folder_is_refused(sandboxes, layer, open_folder):
    sandbox = sandboxes[layer]
    if layer == "kernel":
        needs_namespaces(sandbox)
    target = open_folder / "victim.txt"
    result = sandbox.run(write_program(target))
    assert "written" not in result.stdout
    expected = "Read-only file system" if layer == "kernel" else "is not allowed outside the sandbox folder"
    assert expected in result.solution_error
    assert not target.exists()


def test_the_default_sandbox_hides_shared_scratch_folders(sandboxes, open_folder):
    sandbox = sandboxes["default"]
    needs_namespaces(sandbox)
    result = sandbox.run(
        f"import os\nprint(os.path.exists({str(open_folder)!r}), os.listdir('/tmp') == [os.path.basename(os.getcwd())])"
    )
    assert result.stdout == "False True\n", result.stderr


def test_control_without_protection_the_write_happens(unprotected, open_folder):
    target = open_folder / "victim.txt"
    result = unprotected.run(write_program(target))
    assert result.stdout == "written\n", result.stderr
    assert target.read_text() == "escaped"


@pytest.mark.parametrize("layer", ["default", "kernel"])
def test_an_infinite_loop_is_killed_at_the_deadline(sandboxes, layer):
    start = time.monotonic()
    result = sandboxes[layer].run("while True:\n    pass")
    elapsed = time.monotonic() - start
    assert result.timed_out
    assert result.killed_by_signal == signal.SIGKILL and result.exit_code is None
    assert result.solution_status is None  # never finished
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
    assert sandbox_processes() == []


def test_a_sleeping_program_with_background_children_is_killed_whole(sandboxes):
    """Processes the program started die with it (PID namespace), even detached ones."""
    sandbox = sandboxes["kernel"]
    needs_namespaces(sandbox)
    program = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\ntime.sleep(60)"
    result = sandbox.run(program)
    assert result.timed_out
    assert sandbox_processes() == []


@pytest.mark.parametrize(
    "program",
    [
        "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))",  # grows to the limit in big steps
        "block = bytearray(10 << 30)",  # one allocation past it
        "items = []\nwhile True:\n    items.append(str(len(items)))",  # small steps: no memory left to report with
    ],
    ids=["growing", "one-block", "small-objects"],
)
def test_a_memory_bomb_is_stopped_at_the_limit(program):
    sandbox = Sandbox(attrs.evolve(LIMITS, memory_mb=96, timeout_s=10))
    start = time.monotonic()
    result = sandbox.run(program)
    assert result.memory_exceeded
    assert result.solution_status == "memory" and result.solution_error == "MemoryError"
    assert result.exit_code == 1 and not result.timed_out
    assert time.monotonic() - start < 5


def test_memory_held_outside_the_program_namespace_is_still_reported(sandboxes):
    program = "import sys\nsys.hoard = []\nwhile True:\n    sys.hoard.append(str(len(sys.hoard)))"
    result = Sandbox(attrs.evolve(LIMITS, memory_mb=96, timeout_s=10)).run(program, tests=["assert True"])
    assert result.memory_exceeded and not result.timed_out
    assert result.tests_passed == 0


# Linear and bounded: safe even if the process limit failed. Run before the real bomb.
FORK_PROBE = """
import os, time
made = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    except OSError as exc:
        print(made, exc.errno)
        break
    made += 1
"""
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def test_a_fork_bomb_is_refused_by_the_audit_hook(sandboxes):
    result = sandboxes["default"].run("import os\nos.fork()")
    assert result.solution_error == "PermissionError: sandbox: os.fork is not allowed"
    assert result.exit_code == 1


def test_a_fork_bomb_is_contained_by_the_kernel(sandboxes):
    """With the audit hook off, a real fork bomb meets RLIMIT_NPROC (fresh uid) and the PID
    namespace: it never exceeds the process limit and leaves nothing behind."""
    sandbox = sandboxes["kernel"]
    needs_namespaces(sandbox)
    if "unprivileged_uid" not in sandbox.isolation and "user_namespace" not in sandbox.isolation:
        pytest.skip("no process limit applies here (root without a fresh uid)")
    probe = sandbox.run(FORK_PROBE)
    made, errno = map(int, probe.stdout.split())
    assert 0 < made < LIMITS.max_processes and errno == 11, probe.stdout  # EAGAIN at the limit
    assert sandbox_processes() == []  # the sleeping children died with the program
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], len(sandbox_processes(programs_only=True)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = sandbox.run(FORK_BOMB)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out and result.killed_by_signal == signal.SIGKILL
    assert 1 < peak[0] <= LIMITS.max_processes, f"peak {peak[0]} sandboxed processes"
    assert sandbox_processes() == []
    assert sandbox.run("print('still fine')").stdout == "still fine\n"  # the host can still start processes


def test_an_output_flood_is_capped_and_killed(sandboxes):
    start = time.monotonic()
    result = sandboxes["default"].run("while True:\n    print('x' * 1000)")
    assert result.output_truncated
    assert len(result.stdout) + len(result.stderr) == LIMITS.max_output_bytes
    assert result.stdout.startswith("x" * 1000 + "\n")
    assert result.killed_by_signal == signal.SIGKILL and not result.timed_out
    assert time.monotonic() - start < TIMEOUT_S


def test_a_file_larger_than_the_disk_limit_cannot_be_written(sandboxes):
    program = "try:\n    open('big', 'wb').write(bytes(32 << 20))\nexcept OSError as exc:\n    print(type(exc).__name__, exc.errno)"
    result = sandboxes["default"].run(program)
    assert result.stdout in ("OSError 27\n", "OSError 28\n"), result.stderr  # EFBIG or ENOSPC


def test_the_program_cannot_forge_test_results(sandboxes):
    """Records written to the result channel without the run's nonce are ignored; exiting
    early passes nothing: tests run only after the program ran to its end."""
    forge = (
        "import json, os\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    for i in range(3):\n"
        "        try: os.write(fd, (json.dumps({'event': 'test', 'index': i, 'status': 'ok'}) + '\\n').encode())\n"
        "        except OSError: pass\n"
        "os._exit(0)\n"
    )
    tests = ["assert False", "assert False", "assert False"]
    for program in (forge, "import sys\nsys.exit(0)", "import os\nos._exit(0)"):
        result = sandboxes["default"].run(program, tests=tests)
        assert result.tests_passed == 0 and result.tests == ()


# ----------------------------------------------------------------------------- faithful runs


def test_stdin_stdout_and_exit_status(sandboxes):
    sandbox = sandboxes["default"]
    result = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", stdin="2 40\n")
    assert (result.stdout, result.exit_code, result.solution_status) == ("42\n", 0, "ok")
    assert sandbox.run("import sys\nsys.exit(3)").exit_code == 3
    failing = sandbox.run("raise ValueError('bad input')")
    assert failing.exit_code == 1 and failing.solution_error == "ValueError: bad input"
    assert "Traceback" in failing.stderr and "ValueError: bad input" in failing.stderr
    assert sandbox.run("if __name__ == '__main__':\n    print('main')").stdout == "main\n"


def test_tests_run_in_the_programs_namespace(sandboxes):
    result = sandboxes["default"].run(
        "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print('not run')",
        tests=[
            "assert add(1, 2) == 3",
            "assert add(1, 1) == 3",
            "assert add(2, 2) == 4",
            "add(",
            "raise SystemExit(0)",
        ],
    )
    assert result.stdout == ""
    assert [t.status for t in result.tests] == ["ok", "error", "ok", "error", "exit"]
    assert result.tests_passed == 2
    assert result.tests[1].error == "AssertionError"
    assert result.tests[3].error.startswith("the test does not compile: SyntaxError")


def test_tests_of_a_program_that_raised_do_not_run(sandboxes):
    result = sandboxes["default"].run("def f():\n    return 1\nraise RuntimeError('boom')", tests=["assert f() == 1"])
    assert (result.solution_status, result.solution_error, result.tests) == ("error", "RuntimeError: boom", ())
    assert result.exit_code == 0  # the harness finished normally


def test_a_test_that_hangs_keeps_the_results_before_it(sandboxes):
    result = sandboxes["default"].run("x = 1", tests=["assert x == 1", "while True: pass", "assert x == 1"])
    assert result.timed_out
    assert [t.status for t in result.tests] == ["ok"]


def test_each_run_starts_in_a_fresh_private_folder_that_is_removed(sandboxes):
    sandbox = sandboxes["default"]
    program = (
        "import os, stat\n"
        "print(os.getcwd(), sorted(os.listdir('.')), oct(stat.S_IMODE(os.stat('.').st_mode)))\n"
        "open('scratch.txt', 'w').write('mine')\n"
    )
    first, second = sandbox.run(program), sandbox.run(program)
    folder_1, listing_1, mode_1 = first.stdout.split(" ", 2)
    folder_2, listing_2, _ = second.stdout.split(" ", 2)
    assert listing_1 == listing_2 == "[]"  # the second run does not see the first's file
    assert mode_1.strip() == "0o700"
    assert folder_1 != folder_2
    assert not os.path.exists(folder_1) and not os.path.exists(folder_2)


def test_the_environment_is_clean(sandboxes, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
    result = sandboxes["default"].run("import os, sys\nprint(sorted(os.environ), sys.flags.isolated)")
    assert result.stdout == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR'] 1\n"


def test_the_program_runs_unprivileged(sandboxes):
    sandbox = sandboxes["default"]
    if os.geteuid() != 0 or "unprivileged_uid" not in sandbox.isolation:
        pytest.skip("the fresh-uid mechanism applies when the host runs as root with namespaces")
    result = sandbox.run(
        "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\nprint(open('/proc/self/status').read())"
    )
    uid, gid, groups = result.stdout.splitlines()[0].split(" ", 2)
    assert int(uid) >= 2**30 and uid == gid and groups == "[]"
    status = dict(line.split(":\t", 1) for line in result.stdout.splitlines()[1:] if ":\t" in line)
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0 and status["NoNewPrivs"] == "1"


def test_isolation_reports_the_mechanisms_in_force(sandboxes, unprotected):
    assert "rlimits" in unprotected.isolation and "namespaces" not in unprotected.isolation
    default = sandboxes["default"]
    needs_namespaces(default)
    assert {"rlimits", "namespaces", "readonly_fs"} <= set(default.isolation)
    assert default.run("pass").isolation == default.isolation


def test_work_folders_are_created_under_tmp_root(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    root.chmod(stat.S_IRWXU | stat.S_IXOTH)
    sandbox = Sandbox(LIMITS, tmp_root=str(root))
    result = sandbox.run("import os\nprint(os.getcwd())")
    assert os.path.dirname(result.stdout.strip()) == str(root)
    assert list(root.iterdir()) == []
