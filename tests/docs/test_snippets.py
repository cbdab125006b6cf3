"""Every code block of every page of the documentation site runs, or is checked.

The scheme (also described to readers in docs/plugins/index.md, "How these pages are tested"):

- Pages run in the order of ``mkdocs.yml``'s nav, one test each, in one scratch folder
  shared by all of them. It holds links to the repository's ``examples/``, ``benchmarks/``,
  ``plugins/``, ``core/``, ``noxfile.py`` and ``constraints.txt``, so commands written
  for the repository root work there, and the tiny model that "Getting started" builds
  (``runs/tiny_model``, which later pages use), so that any page also runs alone.
- ``python`` blocks run, in this process, the blocks of one page in one namespace (as in
  one interpreter session); their asserts are the checks. Tracebacks name the page and
  its line.
- A block with ``title="PATH"`` is a file, written to PATH: Python files are compiled,
  YAML files loaded as run configs (:func:`posttrain.config.load_config`), JSON Lines files
  read row by row as posttrain reads data rows (format detected from the first row, every
  row parsed), TOML files parsed.
- ``yaml`` blocks without a title are run configs, loaded and validated through
  :func:`posttrain.config.load_config` from a file. Without an ``algorithm`` key, a
  top-level section named after an installed algorithm makes that the algorithm, so the
  algorithm's own checks run, as under ``posttrain run NAME``.
- ``toml`` blocks are parsed; a ``[project]`` must register a ``posttrain`` entry point.
- ``json`` blocks without a title: every line is a JSON value.
- ``bash`` blocks: see :mod:`commands` (cheap commands run, long ones are parsed and their
  configs checked; an unknown command fails).
- Blocks without a language are output or diagrams: not run.

Each page gets a fresh plugin host (so a package a page "installs" with ``pip install -e``
is seen), and what a page added to ``sys.path``, ``sys.modules`` and the environment is
removed after it. A Ray cluster a page started is shut down after it.
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from posttrain import plugins
from posttrain.config import RunConfig, load_config
from posttrain.data import detect_format, parse_row
from tests.docs.commands import check_command, command_lines
from tests.docs.pages import REPO, Block, blocks, nav_pages

LINKED = ("examples", "benchmarks", "plugins", "core", "noxfile.py", "constraints.txt")
SHELLS = ("bash", "sh", "shell", "console")
TINY_MODEL = "runs/tiny_model"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("docs-workspace")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    build_tiny_model(root / TINY_MODEL)  # what "Getting started" builds, so that any page runs alone
    return root


class PageSession:
    """One page's run: its namespace, the paths it installed, its block handlers."""

    def __init__(self, page: str, root: Path):
        self.page = page
        self.root = root
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        self.paths: list[Path] = []
        self.site = root / ".site" / page.replace("/", "_")

    # ------------------------------------------------------------------ blocks

    def run(self, block: Block) -> None:
        if block.title is not None:
            self.write_file(block)
        elif block.language == "python":
            padded = "\n" * (block.line) + block.text  # line numbers in tracebacks are the page's
            exec(compile(padded, f"docs/{block.page}", "exec"), self.namespace)
        elif block.language == "yaml":
            path = self.root / ".blocks" / f"{block.page.replace('/', '_')}_{block.line}.yaml"
            path.parent.mkdir(exist_ok=True)
            path.write_text(block.text)
            self.load(path)
        elif block.language == "toml":
            check_pyproject(tomllib.loads(block.text), block.where)
        elif block.language == "json":
            for line in block.text.splitlines():
                json.loads(line)
        elif block.language in SHELLS:
            for words in command_lines(block.text):
                check_command(words, self)
        elif block.language not in ("", "text"):
            raise AssertionError(f"{block.where}: no check for ```{block.language} blocks; see tests/docs/test_snippets.py")

    def write_file(self, block: Block) -> None:
        path = self.root / block.title
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text)
        suffix = path.suffix
        if suffix == ".py":
            compile(block.text, block.where, "exec")
        elif suffix in (".yaml", ".yml"):
            self.load(path)
        elif suffix == ".jsonl":
            check_rows(block.text, block.where)
        elif suffix == ".toml":
            data = tomllib.loads(block.text)
            if path.name == "pyproject.toml":
                check_pyproject(data, block.where)
        else:
            raise AssertionError(f"{block.where}: no check for files named *{suffix}; see tests/docs/test_snippets.py")

    # ------------------------------------------------------------------ what commands use

    def load(self, path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
        """Load a run config as ``posttrain run`` would; a section named after an installed
        algorithm selects it when the file and overrides choose none."""
        host = plugins.plugin_host()
        config = load_config(path, overrides)
        if config.algorithm is None:
            named = [name for name in config.raw if name in host.algorithms]
            assert len(named) <= 1, f"{path}: sections of several algorithms ({named}); set 'algorithm'"
            if named:
                config = load_config(path, [*overrides, f"algorithm={named[0]}"])
        return config

    def install(self, folder: Path) -> None:
        """What ``pip install -e folder`` leaves behind for Python: the distribution's metadata
        and entry points in a site folder on the path, and its package folder on the path."""
        project = tomllib.loads((folder / "pyproject.toml").read_text())
        meta = project["project"]
        info = self.site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
        groups = meta.get("entry-points", {})
        (info / "entry_points.txt").write_text(
            "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in groups.items())
        )
        where = project.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("where", ["."])
        for path in [self.site, *(folder / w for w in where)]:
            if path not in self.paths:
                self.paths.append(path)
                sys.path.insert(0, str(path))
        plugins.set_plugin_host(None)  # the next plugin_host() loads the new entry points


def check_rows(text: str, where: str) -> None:
    """Each line is a data row of the format the first row shows, as posttrain reads a file."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    fmt = detect_format(rows[0])
    assert fmt is not None, f"{where}: the first row's keys {sorted(rows[0])} show no format"
    for row in rows:
        parse_row(row, fmt)


def check_pyproject(data: dict[str, Any], where: str) -> None:
    if "project" in data:
        entry_points = data["project"].get("entry-points", {}).get("posttrain")
        assert entry_points, f"{where}: [project.entry-points.posttrain] registers no plugin module"


@pytest.fixture
def page_state(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Restore what a page may change: cwd, sys.path, modules, the plugin host, Ray."""
    import ray

    monkeypatch.chdir(workspace)
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    saved_host, ray_before = plugins._HOST, ray.is_initialized()
    plugins.set_plugin_host(None)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(workspace)):
                del sys.modules[name]
        plugins.set_plugin_host(saved_host)
        if ray.is_initialized() and not ray_before:
            ray.shutdown()


PAGES = nav_pages()


def test_every_page_is_in_the_nav():
    on_disk = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert sorted(PAGES) == on_disk


@pytest.mark.parametrize("page", PAGES)
def test_page_code_blocks(page: str, workspace: Path, page_state: None) -> None:
    session = PageSession(page, workspace)
    for block in blocks(page):
        try:
            session.run(block)
        except Exception as error:  # every failure names the block it came from
            raise AssertionError(f"{block.where} ({block.language or 'no language'} block): {type(error).__name__}: {error}") from error
