"""Each algorithm distribution installs alone on core, as a third-party plugin
would: a clean virtual environment with core (without torch or Ray), then the distribution
and the posttrain distributions it declares, nothing else; ``posttrain plugins`` lists
exactly what it registers, and uninstalling it leaves core's listing as it was."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.core.test_plugins import BASE_PYTHON, REPO, _copy, _run, _version

#: folder -> the lines ``posttrain plugins`` adds for it (besides those of its dependencies).
DISTRIBUTIONS = {
    "plugins/algorithms/eval": ["  algorithm: eval", "  command: eval", "  config section: eval"],
    "plugins/algorithms/rm": ["  environment: reward_model", "  loss: bradley_terry", "  algorithm: rm",
                              "  config section: rm"],
    "plugins/algorithms/distill": ["  algorithm: distill", "  config section: distill"],
    "plugins/algorithms/ppo": ["  algorithm: ppo", "  config section: ppo"],
}


def _posttrain_dependencies(folder: Path) -> list[str]:
    """The posttrain distributions (other than core) ``folder`` declares, as repository folders."""
    folders = {tomllib.loads((p / "pyproject.toml").read_text())["project"]["name"]: p
               for p in (REPO / "plugins").glob("*/*") if (p / "pyproject.toml").is_file()}
    declared = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [d.split(">")[0].split("=")[0].split("[")[0].strip() for d in declared]
    return [str(folders[name].relative_to(REPO)) for name in names if name in folders]


@pytest.mark.slow
def test_each_new_algorithm_installs_alone_on_core(tmp_path):
    if not Path(BASE_PYTHON).exists():
        pytest.skip(f"base interpreter {BASE_PYTHON} not found")
    _run(BASE_PYTHON, "-m", "venv", tmp_path / "venv", cwd=tmp_path)
    bin_dir = tmp_path / "venv" / "bin"
    pip = [bin_dir / "python", "-m", "pip"]
    _run(*pip, "install", "--quiet", "pluggy", "attrs", "structlog", "PyYAML", "omegaconf", cwd=tmp_path)
    _run(*pip, "install", "--quiet", "--no-deps", _copy(REPO / "core", tmp_path / "core"), cwd=tmp_path)
    core_only = _run(bin_dir / "posttrain", "plugins", cwd=tmp_path)

    for folder, lines in DISTRIBUTIONS.items():
        wanted = [*_posttrain_dependencies(REPO / folder), folder]
        copies = [_copy(REPO / path, tmp_path / folder.replace("/", "_") / path.replace("/", "_")) for path in wanted]
        _run(*pip, "install", "--quiet", "--no-deps", *copies, cwd=tmp_path)
        listing = _run(bin_dir / "posttrain", "plugins", cwd=tmp_path)
        assert listing.startswith(core_only), listing
        name = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]["name"]
        head = f"{name} {_version(REPO / folder)} (plugin '{folder.rsplit('/', 1)[1]}')"
        added = listing[len(core_only):].splitlines()
        assert head in added and "error" not in listing, listing
        assert added[added.index(head) + 1:added.index(head) + 1 + len(lines)] == lines, listing
        names = [tomllib.loads((REPO / path / "pyproject.toml").read_text())["project"]["name"] for path in wanted]
        _run(*pip, "uninstall", "--yes", "--quiet", *names, cwd=tmp_path)
        assert _run(bin_dir / "posttrain", "plugins", cwd=tmp_path) == core_only
