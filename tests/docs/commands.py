"""The shell commands of the documentation pages: which run for real, and how the long ones
are checked without running them. :func:`check_command` dispatches one command line.

Every command runs in the pages' scratch folder. ``session.paths`` are folders a page added
to the Python path (a package it "installed"); subprocesses get them in ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
from packaging.requirements import Requirement

from posttrain.config import RunConfig
from posttrain_launch.command import run_command

_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
COMMAND_TIMEOUT_S = 240


class Session(Protocol):
    """What a command needs from the page being run."""

    root: Path  # the scratch folder (cwd)
    paths: list[Path]  # extra Python path entries

    def install(self, folder: Path) -> None: ...

    def load(self, path: str | Path, overrides: Sequence[str] = ()) -> RunConfig: ...


def command_lines(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, ``&&``
    chains split; each command as its words."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1:]
    return [command for command in commands if command]


def check_command(words: list[str], session: Session) -> None:
    """Run or check one command; raise AssertionError saying what is wrong."""
    env: dict[str, str] = {}
    while words and _ENV_ASSIGNMENT.match(words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    program, args = _program(words)
    handler = _HANDLERS.get(program)
    if handler is None:
        raise AssertionError(
            f"no check for the command {shlex.join(words)!r}: add one to tests/docs/commands.py "
            f"(known: {', '.join(sorted(_HANDLERS))})"
        )
    with _environ(env):
        handler(args, session)


def _program(words: list[str]) -> tuple[str, list[str]]:
    """``python3 -m pip install x`` -> ``("pip", ["install", "x"])``; a script run by Python
    -> ``("python-script", [script, ...])``."""
    head, *args = words
    if head in ("python", "python3"):
        if args[:1] == ["-m"] and len(args) > 1:
            return args[1], args[2:]
        if args[:1] == ["-c"]:
            return "python-c", args[1:]
        return "python-script", args
    return head, args


# --------------------------------------------------------------------------- handlers


def _posttrain(args: list[str], session: Session) -> None:
    """``posttrain plugins`` runs; other subcommands are parsed by posttrain's own command
    line, and ``posttrain run`` also loads and checks its config, model folder and data."""
    if args == ["plugins"]:
        _plugins_listing(tuple(session.paths))
        return
    parsed = parse_posttrain(args)
    if parsed.command == "run":
        config = session.load(parsed.config, [*parsed.overrides, f"algorithm={parsed.algorithm}"])
        check_run_inputs(config)
    elif parsed.command == "launch" and parsed.launcher in ("slurm", "kuberay"):
        # the run it launches: parsed, its config loaded and checked (its inputs are on the cluster)
        inner = parse_posttrain(run_command(parsed.run_words, parsed.nodes)[1:])
        session.load(inner.config, [*inner.overrides, f"algorithm={inner.algorithm}"])


@functools.cache
def _plugins_listing(paths: tuple[Path, ...]) -> str:
    """``posttrain plugins`` run once per set of installed extras (its output depends on nothing else)."""
    return _run([str(Path(sys.executable).parent / "posttrain"), "plugins"], paths, Path.cwd())


def parse_posttrain(argv: Sequence[str]) -> argparse.Namespace:
    """The namespace ``posttrain.cli.main(argv)`` hands to its command, without running the
    command (its ``func`` is replaced by one that records the namespace)."""
    from posttrain import cli

    recorded: list[argparse.Namespace] = []
    original = argparse.ArgumentParser.parse_known_args
    depth = 0

    def parse_known_args(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> tuple[argparse.Namespace, list[str]]:
        nonlocal depth
        depth += 1
        try:
            namespace, extra = original(self, *a, **kw)
        finally:
            depth -= 1
        if depth == 0 and hasattr(namespace, "func"):  # the top-level parse: record instead of running
            namespace.func = lambda parsed: recorded.append(parsed) or 0
        return namespace, extra

    previous = signal.getsignal(signal.SIGTERM)
    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    try:
        status = cli.main(list(argv))
    except SystemExit as exit_:
        raise AssertionError(f"posttrain {shlex.join(argv)}: the command line refused it (exit {exit_.code})") from None
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
        signal.signal(signal.SIGTERM, previous)
    assert status == 0 and recorded, f"posttrain {shlex.join(argv)}: exit status {status}"
    return recorded[0]


#: Cores of the machine the documented commands must run on as written.
CORES = 2


def check_run_inputs(config: RunConfig) -> None:
    """What ``posttrain run`` checks before any worker starts, short of a checkpoint to
    resume: the model folders, that the run's parts fit the cluster it starts on a machine
    of :data:`CORES` cores (``cluster.num_cpus`` null: one logical CPU per core); and that
    the data files exist."""
    from posttrain.config.demands import check_demands_fit, run_demands, started_cluster_size
    from posttrain.models.folder import check_model_folders
    from posttrain.plugins import plugin_host

    check_model_folders(config)
    if not config.cluster.ray_address:
        cluster = attrs.evolve(config.cluster, num_cpus=config.cluster.num_cpus or CORES)
        check_demands_fit(config, run_demands(config, plugin_host()), started_cluster_size(attrs.evolve(config, cluster=cluster)))
    for split in ("train", "validation"):
        path = getattr(config.data, split)
        if isinstance(path, str):
            assert Path(path).is_file(), f"data.{split}: '{path}' is not a file"


def _python_c(args: list[str], session: Session) -> None:
    """``python -c CODE``: runs, in this interpreter."""
    code, *rest = args
    assert not rest, f"python -c: unexpected arguments {rest}"
    exec(compile(code, "<python -c>", "exec"), {"__name__": "__main__"})


class _Parsed(Exception):
    """Raised by the patched argument parser once a script's arguments parsed."""


def _python_script(args: list[str], session: Session) -> None:
    """``python SCRIPT ARGS``: the script runs until its argument parser has accepted ARGS."""
    script, *argv = args
    path = session.root / script
    assert path.is_file(), f"python {script}: no such script"
    original = argparse.ArgumentParser.parse_known_args
    depth = 0

    def parse_known_args(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> tuple[argparse.Namespace, list[str]]:
        nonlocal depth
        depth += 1
        try:
            result = original(self, *a, **kw)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed(result)
        return result

    saved_argv, saved_path, saved_modules = sys.argv, list(sys.path), set(sys.modules)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except _Parsed as parsed:
        namespace, extra = parsed.args[0]
        assert not extra, f"python {shlex.join(args)}: unrecognized arguments {extra}"
        return
    except SystemExit as exit_:
        raise AssertionError(f"python {shlex.join(args)}: the script's parser refused it (exit {exit_.code})") from None
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in set(sys.modules) - saved_modules:  # the script's sibling modules (common, ...)
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(path.parent)):
                del sys.modules[name]
    raise AssertionError(f"python {script}: finished without parsing command-line arguments")


def _pip(args: list[str], session: Session) -> None:
    """``pip install``: folders the page wrote are installed (their metadata and entry points
    written into the page's site folder); repository folders must be distributions (with
    the extras named); packages must be pinned in the constraints file."""
    sub, *rest = args
    assert sub == "install", f"pip {sub}: only 'pip install' is checked"
    constraints: dict[str, Requirement] = {}
    editable: list[str] = []
    requirements: list[str] = []
    words = iter(rest)
    for word in words:
        if word in ("-c", "--constraint"):
            file = session.root / next(words)
            assert file.is_file(), f"pip install: constraints file {file.name} not found"
            constraints.update(_pins(file))
        elif word in ("-e", "--editable"):
            editable.append(next(words))
        elif word in ("-q", "--quiet", "-U", "--upgrade"):
            continue
        else:
            assert not word.startswith("-"), f"pip install: option {word} is not checked; add it to tests/docs/commands.py"
            requirements.append(word)
    for target in editable:
        folder, extras = _folder_and_extras(target)
        path = session.root / folder
        assert (path / "pyproject.toml").is_file(), f"pip install -e {target}: {folder} holds no pyproject.toml"
        declared = tomllib.loads((path / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
        missing = [extra for extra in extras if extra not in declared]
        assert not missing, f"pip install -e {target}: {folder} declares no extra {missing}"
        if path.resolve().is_relative_to(session.root.resolve()):  # written by a page, not a repository folder
            session.install(path)
    for text in requirements:
        requirement = Requirement(text)
        pin = constraints.get(requirement.name.lower())
        assert pin is not None, f"pip install {text}: {requirement.name} is not pinned in the constraints file"
        if requirement.specifier:
            assert str(requirement.specifier) == str(pin.specifier), (
                f"pip install {text}: the constraints file pins {pin}"
            )


def _folder_and_extras(target: str) -> tuple[str, list[str]]:
    match = re.fullmatch(r"(.+?)(?:\[([\w,-]+)\])?", target)
    assert match, target
    return match[1], match[2].split(",") if match[2] else []


def _pins(file: Path) -> dict[str, Requirement]:
    pins = {}
    for line in file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            pins[requirement.name.lower()] = requirement
    return pins


def _nox(args: list[str], session: Session) -> None:
    """``nox -s NAME [-- ARGS]``: NAME must be a session of noxfile.py (not run)."""
    options = args[: args.index("--")] if "--" in args else args
    assert options[:1] == ["-s"] and len(options) == 2, f"nox {shlex.join(args)}: expected 'nox -s SESSION'"
    sessions = nox_sessions(session.root / "noxfile.py")
    assert options[1] in sessions, f"nox: no session '{options[1]}' in noxfile.py (sessions: {', '.join(sessions)})"


def nox_sessions(noxfile: Path) -> list[str]:
    """The names of the functions decorated with ``nox.session`` in ``noxfile``."""
    tree = ast.parse(noxfile.read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and target.attr == "session":
                    names.append(node.name)
    return names


def _pytest(args: list[str], session: Session) -> None:
    """``pytest ARGS``: runs, in a subprocess."""
    _run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"], session.paths, session.root)


def _ray(args: list[str], session: Session) -> None:
    """``ray start ...``: parsed by Ray's own command line (not run)."""
    from ray.scripts.scripts import cli

    sub, *rest = args
    assert sub == "start", f"ray {sub}: only 'ray start' is checked"
    cli.commands["start"].make_context("start", list(rest))


def _sbatch(args: list[str], session: Session) -> None:
    """``sbatch SCRIPT``: the script exists and ``bash -n`` accepts it (not submitted)."""
    (script,) = args
    path = session.root / script
    assert path.is_file(), f"sbatch {script}: no such file"
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, f"sbatch {script}: bash -n says {checked.stderr}"


def _kubectl(args: list[str], session: Session) -> None:
    """``kubectl apply -f MANIFEST``: the manifest exists and is a KubeRay RayJob (not applied)."""
    import yaml

    assert args[:2] == ["apply", "-f"] and len(args) == 3, f"kubectl {shlex.join(args)}: only 'kubectl apply -f FILE' is checked"
    path = session.root / args[2]
    assert path.is_file(), f"kubectl apply -f {args[2]}: no such file"
    manifest = yaml.safe_load(path.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob"), f"{args[2]} is not a ray.io/v1 RayJob"


_HANDLERS = {
    "posttrain": _posttrain,
    "python-c": _python_c,
    "python-script": _python_script,
    "pip": _pip,
    "nox": _nox,
    "pytest": _pytest,
    "ray": _ray,
    "sbatch": _sbatch,
    "kubectl": _kubectl,
}


# --------------------------------------------------------------------------- helpers


def _run(argv: list[str], paths: Sequence[Path], cwd: Path) -> str:
    """Run ``argv`` in ``cwd`` with ``paths`` first on its Python path; its output, or an
    AssertionError with the end of it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, f"{shlex.join(argv)} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
