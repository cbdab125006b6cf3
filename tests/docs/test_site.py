"""The documentation site builds with ``mkdocs build --strict`` (as ``nox -s docs`` does: a
broken link or anchor fails), and its configuration reference page lists every key of
core's sections and of every installed plugin's sections, a plugin installed after the
pages were written included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import attrs
import pytest

from posttrain.config.schema import RunConfig
from posttrain.config.structure import LOADER_FIELDS
from posttrain.plugins import plugin_host
from tests.docs.pages import REPO

#: A plugin the pages know nothing about, installed for the build only.
PROBE_MODULE = '''
import attrs
from posttrain import hookimpl


@attrs.define
class LateSource:
    url: str = ""  # where it is


@attrs.define
class LateConfig:
    """Installed after the pages were written."""

    budget: int = 3  # how many
    source: str | LateSource | None = None


@hookimpl
def posttrain_config_sections():
    return {"late_probe": LateConfig, "generation.late_probe": LateSource}
'''
PROBE_KEYS = {"late_probe.budget", "late_probe.source", "late_probe.source.url", "generation.late_probe.url"}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    extra = tmp_path_factory.mktemp("late-plugin")
    (extra / "late_probe_plugin.py").write_text(PROBE_MODULE)
    info = extra / "posttrain_late_probe-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posttrain-late-probe\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[posttrain]\nlate_probe = late_probe_plugin\n")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(extra), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "WARNING" not in done.stderr, done.stderr
    return out


def keys_of(cls: type, path: str, exclude: frozenset[str] = frozenset()) -> set[str]:
    """Every dotted key of an attrs class under ``path``: its fields, and the fields of the
    attrs classes their values may be (a section, or one member of a union)."""
    out = set()
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        if not field.init or field.name in exclude:
            continue
        key = f"{path}.{field.alias}" if path else field.alias
        out.add(key)
        hint = hints[field.name]
        members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        for member in members:
            if attrs.has(member):
                out |= keys_of(member, key)
    return out


def page_ids(site: Path, page: str) -> set[str]:
    html = (site / page / "index.html").read_text(encoding="utf-8")
    return set(re.findall(r'id="([^"]+)"', html))


def test_the_reference_lists_every_key_of_core_and_of_every_installed_plugin(site: Path) -> None:
    ids = page_ids(site, "reference/configuration")
    host = plugin_host()
    expected = keys_of(RunConfig, "", LOADER_FIELDS)
    for name in host.config_sections:
        expected |= {name} | keys_of(host.config_sections[name], name)
    missing = sorted(expected - ids)
    assert not missing, f"keys missing from the configuration reference: {missing}"
    assert {"grpo.baseline", "policy.dtensor.attn_implementation", "data_plane.transferqueue.namespace"} <= ids


def test_a_plugin_installed_after_the_pages_were_written_is_listed(site: Path) -> None:
    ids = page_ids(site, "reference/configuration")
    assert PROBE_KEYS <= ids
    html = (site / "reference/configuration/index.html").read_text(encoding="utf-8")
    assert "Installed after the pages were written." in html
    assert "from plugin <code>posttrain-late-probe 0.1.0</code>" in html


def test_environment_options_are_generated_on_their_page(site: Path) -> None:
    from posttrain_env_code.options import CodeOptions
    from posttrain_env_math.options import GuessNumberOptions, MathOptions

    ids = page_ids(site, "environments")
    for cls, prefix in ((MathOptions, "environments.math"), (GuessNumberOptions, "environments.guess_number"),
                        (CodeOptions, "environments.code")):
        assert keys_of(cls, prefix) <= ids


def test_every_page_is_built(site: Path) -> None:
    for source in (REPO / "docs").rglob("*.md"):
        page = source.relative_to(REPO / "docs").with_suffix("")  # x.md -> x/index.html, a/index.md -> a/index.html
        folder = site / page.parent if page.name == "index" else site / page
        assert (folder / "index.html").is_file(), f"docs/{page}.md was not built"
