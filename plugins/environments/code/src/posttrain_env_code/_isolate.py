"""Stage 1 of a sandbox run: confine this process, then become the program's interpreter.

Executed as a script, ``python -I -S _isolate.py SPEC_JSON``, by :mod:`posttrain_env_code.sandbox`
(standard library only: it runs before any site-packages are trusted). What it does, in
order (each step's failure is reported on the result channel as ``{"setup_error": ...}``
with exit status :data:`SETUP_FAILED`):

1. Dies with its parent (``PR_SET_PDEATHSIG``) and sets the resource limits (address space,
   CPU time, file size, open files, no core dumps).
2. With ``namespaces``: ``unshare`` new mount, network, PID, IPC and UTS namespaces (plus a
   user namespace when not root) and forks; the child is PID 1 of the new PID namespace.
   That child makes every mount read-only (bind remounts, in its own mount namespace),
   hides ``hide`` behind empty tmpfs mounts, mounts a fresh size-limited tmpfs on the work
   folder, mounts a new ``/proc``, and makes the interpreter reachable for the sandbox uid
   (``expose``). It then forks the program's process and waits for it; when PID 1 exits the
   kernel kills every process left in the namespace. The outer process relays the
   program's wait status as its own.
3. The program's process drops privileges (as uid 0: an empty capability bounding set; as
   root given a ``uid``: also that fresh unprivileged uid/gid, so ``RLIMIT_NPROC`` applies), sets the process limit and
   ``PR_SET_NO_NEW_PRIVS``, and ``exec``s ``python -I -c BOOT``.

The first line written to the result channel is ``{"isolation": [...]}``, naming the
mechanisms in force.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import stat
import sys

SETUP_FAILED = 125

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
# Per-mount flags a bind remount must keep (inside a user namespace, dropping them is refused).
_KEPT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A confinement step failed; the program must not run."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what} failed: {os.strerror(errno)} (errno {errno})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None, what: str) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)), what)


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option}, {value})")


def _write_line(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())


def _set_limits(limits: dict) -> None:
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# ----------------------------------------------------------------------------- mounts


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounts() -> list[tuple[str, int]]:
    """``(mount point, per-mount flags to keep)`` for every mount of this mount namespace."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            flags = sum(_KEPT_FLAGS.get(option, 0) for option in fields[5].split(","))
            out.append((_unescape(fields[4]), flags))
    return out


def blocked_ancestor(path: str) -> tuple[str, str] | None:
    """``(directory, child name)`` for the first directory on the way to ``path`` that others
    may not traverse (no ``o+x``), or None when ``path`` is reachable by any uid."""
    current = "/"
    for part in [p for p in os.path.realpath(path).split("/") if p]:
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current, part
        current = os.path.join(current, part)
    return None


def _expose(paths: list[str]) -> None:
    """Make every path in ``paths`` reachable by an unprivileged uid: a directory that blocks
    the way (e.g. ``/root``, mode 0700) is covered by an empty tmpfs holding bind mounts of
    just the entries needed, so nothing else in it becomes visible."""
    for _ in range(16):  # one blocked level per pass; deeper ones show up on the next
        needed: dict[str, set[str]] = {}
        for path in paths:
            if (blocked := blocked_ancestor(path)) is not None:
                needed.setdefault(blocked[0], set()).add(blocked[1])
        if not needed:
            return
        for directory, children in needed.items():
            fds = {child: os.open(os.path.join(directory, child), os.O_PATH) for child in children}
            _mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=16k,mode=0755", f"hiding {directory}")
            for child, fd in fds.items():
                target = os.path.join(directory, child)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                _mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND | _MS_REC, None, f"exposing {target}")
                os.close(fd)
    raise SetupError(f"could not make {paths} reachable for the sandbox uid")


def _setup_mounts(spec: dict) -> None:
    workdir = spec["workdir"]
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE, None, "making mounts private")
    if spec["uid"] is not None:
        _expose(spec["expose"])
    for path in spec["hide"]:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount(
                "tmpfs",
                path,
                "tmpfs",
                _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                "size=64k,nr_inodes=256,mode=0755",
                f"hiding {path}",
            )
    os.makedirs(workdir, exist_ok=True)  # inside a hiding tmpfs when the folder's parent is hidden
    owner = f",uid={spec['uid']},gid={spec['uid']}" if spec["uid"] is not None else ""
    options = f"size={spec['limits']['file_bytes']},nr_inodes=4096,mode=0700{owner}"
    _mount("tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, options, "mounting the work folder")
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None, "mounting /proc")
    for mount_point, flags in _mounts():
        if mount_point == workdir:
            continue
        result = _libc.mount(
            None, mount_point.encode(), None, ctypes.c_ulong(_MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags), None
        )
        if result != 0 and ctypes.get_errno() != 2:  # ENOENT: under a hidden folder, unreachable anyway
            _check(result, f"remounting {mount_point} read-only")


# ----------------------------------------------------------------------------- processes


def _exec_program(spec: dict) -> None:
    """Drop privileges, set the process limit and become ``python -I -c BOOT``."""
    os.chdir(spec["workdir"])
    nproc = spec["limits"]["processes"]
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if os.geteuid() == 0:  # real root, or root of the run's user namespace
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        for cap in range(last_cap + 1):
            _prctl(_PR_CAPBSET_DROP, cap)  # no exec can grant a capability again
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    python = spec["python"]
    os.execve(python, [python, "-I", "-c", spec["boot"], str(spec["config_fd"])], spec["env"])


def _exit_like(status: int) -> None:
    """End this process the way a child with wait status ``status`` ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # reached only when that signal does not end this process
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _namespace_init(spec: dict, status_fd: int) -> None:
    """PID 1 of the new PID namespace: set up mounts, run the program, relay its status."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _setup_mounts(spec)
    mechanisms = ["rlimits", "namespaces", "readonly_fs"]
    mechanisms.append("unprivileged_uid" if spec["uid"] is not None else "user_namespace")
    _write_line(spec["result_fd"], {"isolation": mechanisms})
    program = os.fork()
    if program == 0:
        os.close(status_fd)
        _exec_program(spec)
    os.close(spec["result_fd"])
    while True:
        pid, status = os.wait()
        if pid == program:
            os.write(status_fd, str(status).encode())
            os._exit(0)  # the kernel now kills whatever the program left running


def _enter_namespaces(spec: dict) -> None:
    in_user_namespace = os.geteuid() != 0
    flags = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(flags | (_CLONE_NEWUSER if in_user_namespace else 0)), "unshare (Linux namespaces)")
    if in_user_namespace:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    status_r, status_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_r)
        try:
            _namespace_init(spec, status_w)
        except BaseException as exc:  # reported like any setup failure, from inside the namespace
            _report_setup_error(spec["result_fd"], exc)
    os.close(status_w)
    _, init_status = os.waitpid(init, 0)
    relayed = os.read(status_r, 32)
    _exit_like(int(relayed) if relayed else init_status)


def _report_setup_error(result_fd: int, exc: BaseException) -> None:
    message = str(exc) if isinstance(exc, SetupError) else f"{type(exc).__name__}: {exc}"
    try:
        _write_line(result_fd, {"setup_error": message})
    finally:
        os._exit(SETUP_FAILED)


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != spec["parent_pid"]:  # the parent died before the line above
            os._exit(SETUP_FAILED)
        _set_limits(spec["limits"])
        if spec["namespaces"]:
            _enter_namespaces(spec)
        mechanisms = ["rlimits"] + (["unprivileged_uid"] if spec["uid"] is not None else [])
        _write_line(spec["result_fd"], {"isolation": mechanisms})
        _exec_program(spec)
    except BaseException as exc:
        _report_setup_error(spec["result_fd"], exc)


if __name__ == "__main__":
    main()
