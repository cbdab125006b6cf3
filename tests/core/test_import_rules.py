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


def imported_modules(path: Path, src: Path, *, skip_type_checking: bool) -> Iterator[tuple[str, int]]:
    """``(module, line)`` of every import in ``path``, functions included (absolute names;
    ``from a import b`` yields ``a.b``, which may be a module or a name in ``a``). With
    ``skip_type_checking``, skips the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, src).split(".")
    if path.name != "__init__.py":
        package = package[:-1]

    def visit(nodes: list[ast.stmt]) -> Iterator[tuple[str, int]]:
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    yield f"{base}.{alias.name}", node.lineno
            elif isinstance(node, ast.If) and skip_type_checking and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from visit(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    yield from visit([child for child in getattr(node, field, []) if isinstance(child, ast.AST)])

    yield from visit(tree.body)


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_imports_no_plugin():
    plugins = plugin_packages()
    assert {"posttrain_dtensor", "posttrain_grpo", "posttrain_env_math", "posttrain_quickstart"} <= set(plugins)
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sources(CORE / "posttrain")
        for name, line in imported_modules(path, CORE, skip_type_checking=False)
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
        for name, line in imported_modules(path, src, skip_type_checking=False)
        if name.split(".")[0] in backends or name == "posttrain.backend" or name.startswith("posttrain.backend.")
    ]
    assert not offences, "algorithms import backends:\n" + "\n".join(offences)


def runtime_graph() -> dict[str, set[str]]:
    """Core module -> the core modules it imports outside type checking. Importing ``a.b.c`` also
    loads the packages ``a`` and ``a.b`` first (their ``__init__``), so those are edges too,
    except into a package the importing module belongs to (already loading)."""
    modules = {module_name(path, CORE): path for path in sources(CORE / "posttrain")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for imported, _ in imported_modules(path, CORE, skip_type_checking=True):
            parts = imported.split(".")
            for end in range(1, len(parts) + 1):
                target = ".".join(parts[:end])
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
    graph = runtime_graph()
    assert "posttrain.config.loader" in graph["posttrain.config"]  # the graph sees package faces
    circle = find_circle(graph)
    assert circle is None, "import circle in core: " + " -> ".join(circle)


def test_the_circle_finder_finds_circles():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
