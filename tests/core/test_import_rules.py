"""The import rules of the house, read from the source (no module is imported):

- core imports no plugin (a plugin is any distribution under ``plugins/`` or ``examples/plugins/``);
- an algorithm imports no backend, neither a backend plugin nor core's backend kit
  (``posttrain.backend``): algorithms talk to interfaces;
- core's modules form no import circle outside type checking: every import counts (at
  module level or inside a function) except those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src"
#: The tests of an ``if`` whose body runs only under a type checker (``if not TYPE_CHECKING:``
#: runs its body at run time: its imports count).
TYPE_CHECKING_TESTS = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def plugin_packages() -> dict[str, Path]:
    """Import name -> source folder of every plugin distribution in the repository."""
    found = {}
    for pyproject in [*ROOT.glob("plugins/*/*/pyproject.toml"), *ROOT.glob("examples/plugins/*/pyproject.toml")]:
        for package in (pyproject.parent / "src").iterdir():
            if (package / "__init__.py").exists():
                found[package.name] = package
    return found


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, src: Path, *, skip_type_checking: bool) -> Iterator[tuple[str, int, bool]]:
    """``(module, line, type_only)`` of every import in ``path``, functions included (absolute
    names; ``from a import b`` yields ``a.b``, which may be a module or a name in ``a``);
    ``type_only``: under ``if TYPE_CHECKING:``. With ``skip_type_checking``, those are skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, src).split(".")
    if path.name != "__init__.py":
        package = package[:-1]

    def visit(nodes: list[ast.stmt], type_only: bool) -> Iterator[tuple[str, int, bool]]:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, node.lineno, type_only
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    yield f"{base}.{alias.name}", node.lineno, type_only
            elif isinstance(node, ast.If) and ast.unparse(node.test) in TYPE_CHECKING_TESTS:
                if not skip_type_checking:
                    yield from visit(node.body, True)
                yield from visit(node.orelse, type_only)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    yield from visit([child for child in getattr(node, field, []) if isinstance(child, ast.AST)], type_only)

    yield from visit(tree.body, False)


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_imports_no_plugin():
    plugins = plugin_packages()
    assert {"posttrain_dtensor", "posttrain_grpo", "posttrain_env_math", "posttrain_quickstart"} <= set(plugins)
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sources(CORE / "posttrain")
        for name, line, _ in imported_modules(path, CORE, skip_type_checking=False)
        if name.split(".")[0] in plugins
    ]
    assert not offences, "core imports plugins:\n" + "\n".join(offences)


def test_algorithms_import_no_backend():
    backends = {name for name, folder in plugin_packages().items() if folder.parts[-4] == "backends"}
    assert backends == {"posttrain_dtensor", "posttrain_megatron", "posttrain_vllm", "posttrain_hf"}
    algorithms = sorted(ROOT.glob("plugins/algorithms/*/src"))
    assert len(algorithms) >= 3
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for src in algorithms
        for path in sources(src)
        for name, line, _ in imported_modules(path, src, skip_type_checking=False)
        if name.split(".")[0] in backends or name == "posttrain.backend" or name.startswith("posttrain.backend.")
    ]
    assert not offences, "algorithms import backends:\n" + "\n".join(offences)


def import_graph(*, skip_type_checking: bool) -> dict[str, set[str]]:
    """Core module -> the core modules it imports (outside type checking, with
    ``skip_type_checking``). Importing ``a.b.c`` at run time also loads the packages ``a``
    and ``a.b`` first (their ``__init__``), so those are edges too, except into a package the
    importing module belongs to (already loading); a type checker reads ``a.b.c`` alone, so a
    type-only import is one edge, to the module it names."""
    modules = {module_name(path, CORE): path for path in sources(CORE / "posttrain")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imported, _, type_only in imported_modules(path, CORE, skip_type_checking=skip_type_checking):
            parts = imported.split(".")
            targets = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
            if type_only:
                targets = [t for t in targets if t in modules][-1:]
            for target in targets:
                own_package = name == target or name.startswith(target + ".")
                if target in modules and not own_package:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as the list of modules around it), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                circle = visit(nxt)
                if circle:
                    return circle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            circle = visit(node)
            if circle:
                return circle
    return None


def test_core_has_no_import_circle_outside_type_checking():
    graph = import_graph(skip_type_checking=True)
    assert "posttrain.config.loader" in graph["posttrain.config"]  # the graph sees package faces
    circle = find_circle(graph)
    assert circle is None, "import circle in core: " + " -> ".join(circle)


def test_core_has_no_import_circle_even_for_type_checking():
    graph = import_graph(skip_type_checking=False)
    circle = find_circle(graph)
    assert circle is None, "import circle in core (type-only imports included): " + " -> ".join(circle)


def test_the_type_checking_guard_is_read_exactly(tmp_path):
    module = tmp_path / "pkg" / "mod.py"
    module.parent.mkdir()
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import typed_only\n"
        "if not TYPE_CHECKING:\n    import at_run_time\n"
    )
    found = list(imported_modules(module, tmp_path, skip_type_checking=False))
    assert found == [("typing.TYPE_CHECKING", 1, False), ("typed_only", 3, True), ("at_run_time", 5, False)]
    found = list(imported_modules(module, tmp_path, skip_type_checking=True))
    assert found == [("typing.TYPE_CHECKING", 1, False), ("at_run_time", 5, False)]


#: The contract: what every plugin implements or passes around. It imports only itself.
CONTRACT = ("posttrain.hookspecs", "posttrain.interfaces", "posttrain.batch", "posttrain.errors", "posttrain.config.schema")


def in_contract(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in CONTRACT)


def test_the_contract_imports_only_the_contract():
    graph = import_graph(skip_type_checking=False)
    contract = [name for name in graph if in_contract(name)]
    assert "posttrain.interfaces.policy" in contract and "posttrain.config.schema" in contract
    offences = [
        f"{name} imports {target}"
        for name in contract
        for target in sorted(graph[name])
        if not in_contract(target) and target != "posttrain"
    ]
    assert not offences, "the contract imports beyond itself:\n" + "\n".join(offences)


def test_the_circle_finder_finds_circles():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_the_interfaces_face_loads_each_name_from_its_module_and_nothing_at_import():
    """``posttrain.interfaces`` lists every name once and loads it lazily: importing the package
    (as a hook module importing ``Command`` does) imports no interface module and no torch."""
    import importlib
    import subprocess
    import sys

    import posttrain.interfaces as face

    assert sorted(face.__all__) == sorted(face._MODULES)
    for name in face.__all__:  # each from the module that defines it (a constant: that module's object)
        value, module = getattr(face, name), f"posttrain.interfaces.{face._MODULES[name]}"
        assert getattr(value, "__module__", module) == module and value is getattr(importlib.import_module(module), name)
    probe = "import sys, posttrain.interfaces; print(sorted(m for m in sys.modules if m.startswith(('torch', 'posttrain.interfaces.'))))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "[]\n"


#: The page that declares the plugin API: every module of core a plugin may import.
API_PAGE = ROOT / "docs" / "plugins" / "api.md"


def public_modules() -> set[str]:
    """The modules listed in the tables of the plugin API's page (a row's first cell)."""
    import re

    return set(re.findall(r"^\| `(posttrain[\w.]*)` \|", API_PAGE.read_text(), flags=re.MULTILINE))


def core_module_of(name: str, modules: set[str]) -> str:
    """The core module an imported ``name`` comes from: the longest prefix that is a module."""
    parts = name.split(".")
    return next(".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in modules)


def test_plugins_and_examples_import_only_the_public_api():
    modules = {module_name(path, CORE) for path in sources(CORE / "posttrain")}
    public = public_modules()
    assert {"posttrain", "posttrain.interfaces", "posttrain.backend.weight_sync"} <= public
    assert not public - modules, f"{API_PAGE.name} lists modules that do not exist: {sorted(public - modules)}"
    folders = [*ROOT.glob("plugins/*/*/src"), *ROOT.glob("examples/plugins/*/src"), ROOT / "examples"]
    offences = sorted({
        f"{path.relative_to(ROOT)}:{line} imports {core_module_of(name, modules)}"
        for folder in folders
        for path in sources(folder)
        for name, line, _ in imported_modules(path, folder, skip_type_checking=False)
        if name.split(".")[0] == "posttrain" and core_module_of(name, modules) not in public
    })
    assert not offences, f"imports beyond the plugin API ({API_PAGE.relative_to(ROOT)}):\n" + "\n".join(offences)
