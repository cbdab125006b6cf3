"""Ray worker processes for the tests' session cluster, forked from a process that has already
imported torch and transformers.

A worker process that imports torch and transformers spends 5-10 s of CPU on it before its
first line of work, and a run of the suite starts about three hundred of them on two cores.
Here a fork server (:func:`serve`) imports them once (a server for vLLM's engine workers
imports vLLM too, :data:`PRELOAD_VLLM`, and with it Ray, so it serves only the workers
whose ``RAY_`` variables are its own: one job's on one raylet); Ray starts each worker through
``runtime_env={"py_executable": ...}`` (:func:`py_executable`) as this module's client, which
hands its command line, environment, working directory and standard streams to the server
and waits for the forked worker to exit. The forked worker then runs Ray's own
``default_worker.py`` exactly as a fresh interpreter would.

What a module read from the environment when the server imported it cannot change in the
fork, so a worker whose environment differs from the server's in such a variable
(:func:`import_time_environment`: OpenMP's, Hugging Face's, torch's, ``PYTHON*``) starts as
a fresh interpreter instead: the client execs Python itself. The thread count is the one
setting a worker changes after start (Ray sets ``OMP_NUM_THREADS`` before the first task);
the fork applies it to torch when it does.

Only the test suite uses this: ``posttrain run`` starts its workers as Ray does, and the
tests that run the ``posttrain`` command still do.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

#: What the server imports before it forks: the imports every policy and engine worker makes.
PRELOAD = ("torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto")
#: What a server for vLLM engine workers imports too: vLLM, the modules an engine imports
#: while it starts on a CPU, and posttrain's engine worker (about 8 s of CPU here).
PRELOAD_VLLM = (*PRELOAD, "vllm", "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "compressed_tensors",
                "posttrain_vllm.worker", "posttrain_vllm.extension", "posttrain_vllm.transfer")
#: Variables read when those modules load; a worker whose values differ starts fresh.
IMPORT_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "TOKENIZERS_",
                        "PYTHON", "CUDA_", "LD_", "VLLM_")
#: Set by Ray after the worker starts and applied by the fork (:func:`_follow_thread_count`).
SET_AFTER_START = frozenset({"OMP_NUM_THREADS"})
_PR_SET_PDEATHSIG = 1


def import_time_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the preloaded modules may read when they load."""
    return {key: value for key, value in env.items()
            if key.startswith(IMPORT_TIME_PREFIXES) and key not in SET_AFTER_START}


def ray_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The ``RAY_`` variables of ``env``: what Ray's C++ configuration reads when Ray is
    imported, and what the raylet gives each worker of a job (its id, the raylet's pid)."""
    return {key: value for key, value in env.items() if key.startswith("RAY_")}


def socket_path(directory: str | Path, env: Mapping[str, str]) -> Path:
    """The server socket for workers with environment ``env``: one per import-time environment."""
    digest = hashlib.sha256(json.dumps(sorted(import_time_environment(env).items())).encode()).hexdigest()[:16]
    return Path(directory) / f"{digest}.sock"


def py_executable(directory: str | Path) -> str:
    """The ``runtime_env`` ``py_executable`` that starts Ray's workers through the servers whose
    sockets are in ``directory``."""
    return f"{sys.executable} {Path(__file__).resolve()} client {directory}"


# ----------------------------------------------------------------------------- the server


def serve(directory: str, preload: Sequence[str] = PRELOAD) -> None:
    """Import ``preload``, then fork one worker per client connection, until the parent dies."""
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # gone with the test process
    path = socket_path(directory, os.environ)
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    set_by_imports = {key: value for key, value in os.environ.items() if before.get(key) != value}
    # Importing Ray (vLLM's engine does) reads Ray's C++ configuration once, from this
    # environment (RAY_JOB_ID, RAY_RAYLET_PID, ...): a fork can only be a worker whose RAY_
    # variables are these.
    ray_env = ray_environment(os.environ) if "ray._raylet" in sys.modules else None
    import gc

    gc.collect()
    gc.freeze()  # the forks share these pages instead of copying them at their first collection
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked workers are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one request, one message
    server.bind(str(path) + ".part")
    server.listen(128)
    os.rename(str(path) + ".part", path)  # clients see the socket only once it listens
    while True:
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        request = json.loads(message)
        if ray_env is not None and ray_environment(request["env"]) != ray_env:
            conn.sendall(json.dumps({"refused": f"this server's Ray was imported with {ray_env}"}).encode())
        elif os.fork() == 0:
            server.close()
            _run_worker(conn, request, fds, set_by_imports)
        for fd in fds:
            os.close(fd)
        conn.close()


def _run_worker(conn: socket.socket, request: dict, fds: list[int], set_by_imports: dict[str, str]) -> None:
    """In the fork: become the client's worker process and run its command; it never returns
    into the server's loop."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn.sendall(json.dumps({"pid": os.getpid()}).encode())
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in set_by_imports.items():  # as the worker's own imports would (torch: TORCHINDUCTOR_CACHE_DIR)
        os.environ.setdefault(key, value)
    sys.argv = request["argv"]
    sys.path[0] = str(Path(sys.argv[0]).parent)  # as `python script.py` sets it
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # its own draws, as a fresh process has
    _follow_thread_count()
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")
    # The worker's exit, as a fresh interpreter's: SystemExit (or an error) unwinds past the
    # server's loop and the interpreter ends, running the atexit handlers and flushing streams.
    sys.exit(0)


def _follow_thread_count() -> None:
    """Give torch the worker's ``OMP_NUM_THREADS``, now and when Ray sets it before a task."""
    import torch
    from ray._private import utils

    def apply() -> None:
        if os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    apply()
    ray_sets = utils.set_omp_num_threads_if_unset

    def set_and_apply() -> bool:
        changed = ray_sets()
        if changed:
            apply()
        return changed

    utils.set_omp_num_threads_if_unset = set_and_apply


class ForkServers:
    """Fork servers (:func:`serve`) with their sockets in ``directory``; :attr:`py_executable`
    starts Ray's workers through them."""

    def __init__(self, directory: str | Path):
        self.directory, self.processes, self.sockets = str(directory), [], []
        self.environ = dict(os.environ)  # as the workers get it: before ray.init sets the driver's PYTHONBREAKPOINT
        self.py_executable = py_executable(self.directory)

    def start(self, extra_env: Mapping[str, str], preload: Sequence[str]) -> None:
        """A server for workers whose import-time environment is this process's (as it was
        when the servers were created) plus ``extra_env``, that imports ``preload``."""
        import subprocess

        env = {**self.environ, **extra_env}
        self.processes.append(subprocess.Popen([sys.executable, __file__, "serve", self.directory, *preload], env=env))
        self.sockets.append(socket_path(self.directory, env))

    def wait(self, timeout_s: float = 180) -> None:
        """Until every server started listens (past ``timeout_s``, its workers start fresh
        until it does); a server that exits raises."""
        import time

        deadline = time.monotonic() + timeout_s
        while not all(path.exists() for path in self.sockets) and time.monotonic() < deadline:
            if any(server.poll() is not None for server in self.processes):
                raise RuntimeError(f"a worker fork server exited: {[server.returncode for server in self.processes]}")
            time.sleep(0.1)

    def close(self) -> None:
        """Kill the servers (the workers they forked live on until they exit)."""
        for server in self.processes:
            server.kill()
            server.wait()


# ----------------------------------------------------------------------------- the client


def client(directory: str, argv: list[str]) -> None:
    """Run ``argv`` (Ray's worker command) in a fork of the matching server, or exec it in a
    fresh interpreter where none matches; return when the fork exits."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(str(socket_path(directory, os.environ)))
    except OSError:  # no server for this environment (or it is gone): a fresh interpreter
        os.execv(sys.executable, [sys.executable, *argv])
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = conn.recv(4096)
    if not reply:
        sys.exit("the worker fork server closed the connection before forking")
    answer = json.loads(reply)
    if "refused" in answer:  # a worker of another Ray job: a fresh interpreter
        os.execv(sys.executable, [sys.executable, *argv])
    pid = answer["pid"]

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        exited = os.pidfd_open(pid)
    except ProcessLookupError:  # the worker is gone already
        return
    select.select([exited], [], [])  # PEP 475: retried after a forwarded signal


if __name__ == "__main__":
    role, directory, *rest = sys.argv[1:]
    if role == "serve":  # serve DIRECTORY [MODULE ...]: the modules to preload, else PRELOAD
        serve(directory, rest or PRELOAD)
    else:
        client(directory, rest)
