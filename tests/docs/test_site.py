"""The documentation site builds with ``mkdocs build --strict`` (as ``nox -s docs`` does: a
broken link or anchor fails), and its configuration reference page lists every key of
core's sections and of every installed plugin's sections, a plugin installed after the
pages were written included. Every built page shows the whole navigation with its own
contents inside it (the content keeps the width wide tables need), renders every Markdown
table as a table, and keeps code spans in table cells whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import typing
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin

import attrs
import pytest

from posttrain.config.schema import RunConfig
from posttrain.config.structure import LOADER_FIELDS
from posttrain.plugins import plugin_host
from tests.docs.pages import DOCS, REPO, nav_pages

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
    from posttrain_env_judge.options import JudgeOptions
    from posttrain_env_math.options import GuessNumberOptions, MathOptions

    ids = page_ids(site, "environments")
    for cls, prefix in ((MathOptions, "environments.math"), (GuessNumberOptions, "environments.guess_number"),
                        (CodeOptions, "environments.code"), (JudgeOptions, "environments.judge")):
        assert keys_of(cls, prefix) <= ids


def test_every_page_is_built(site: Path) -> None:
    for source in (REPO / "docs").rglob("*.md"):
        page = source.relative_to(REPO / "docs").with_suffix("")  # x.md -> x/index.html, a/index.md -> a/index.html
        folder = site / page.parent if page.name == "index" else site / page
        assert (folder / "index.html").is_file(), f"docs/{page}.md was not built"


class Rendered(HTMLParser):
    """What a built page shows a reader: the targets of its navigation links, its tables
    (the cells of each row), the text of its paragraphs and the class of every element."""

    def __init__(self, html: str):
        super().__init__()
        self.links: list[str] = []
        self.tables: list[list[int]] = []
        self.paragraphs: list[str] = []
        self.classes: set[str] = set()
        self._in_paragraph = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        classes = (named.get("class") or "").split()
        self.classes.update(classes)
        if tag == "a" and "md-nav__link" in classes and named.get("href"):
            self.links.append(named["href"] or "")
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append(0)
        elif tag in ("td", "th"):
            self.tables[-1][-1] += 1
        elif tag == "p":
            self._in_paragraph = True
            self.paragraphs.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "p":
            self._in_paragraph = False

    def handle_data(self, data: str) -> None:
        if self._in_paragraph:
            self.paragraphs[-1] += data


def url_of(page: str) -> str:
    """The site path of a page: ``index.md`` -> ``""``, ``a/index.md`` -> ``a/``, ``a/b.md`` -> ``a/b/``."""
    stem = page.removesuffix(".md")
    return "" if stem == "index" else stem.removesuffix("index") if stem.endswith("/index") else f"{stem}/"


def rendered(site: Path, page: str) -> Rendered:
    return Rendered((site / url_of(page) / "index.html").read_text(encoding="utf-8"))


_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)+\|?\s*$")
_FENCED = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def markdown_tables(page: str) -> int:
    """The Markdown tables of a page's source, outside its code blocks (their separator rows)."""
    text = _FENCED.sub("", (DOCS / page).read_text(encoding="utf-8"))
    return sum(1 for line in text.splitlines() if _SEPARATOR.match(line))


def test_every_page_shows_the_whole_navigation_with_its_contents_inside_it(site: Path) -> None:
    pages = nav_pages()
    for page in pages:
        shown = rendered(site, page)
        base = "http://site/" + url_of(page)
        targets = {urljoin(base, href).removeprefix("http://site/").partition("#")[0] for href in shown.links}
        missing = sorted({url_of(p) for p in pages} - targets)
        assert not missing, f"docs/{page}: the navigation has no link to {missing}"
        assert "md-nav--integrated" in shown.classes and "md-sidebar--secondary" not in shown.classes, (
            f"docs/{page}: the table of contents is not inside the navigation (theme feature toc.integrate)"
        )


def test_every_markdown_table_renders_as_a_table(site: Path) -> None:
    for page in nav_pages():
        shown = rendered(site, page)
        leaked = [text.strip()[:80] for text in shown.paragraphs if re.search(r"\|\s*:?-{3,}", text)]
        assert not leaked, f"docs/{page}: table rows shown as text (a table needs a blank line before it): {leaked}"
        assert len(shown.tables) >= markdown_tables(page), f"docs/{page}: {markdown_tables(page)} tables, {len(shown.tables)} rendered"
        assert all(len(rows) >= 2 for rows in shown.tables), f"docs/{page}: a table without rows"
    assert len(rendered(site, "reference/configuration.md").tables) > 20


def test_code_in_table_cells_breaks_between_words_only(site: Path) -> None:
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert re.search(r"\.md-typeset td code\s*\{[^}]*word-break:\s*normal;[^}]*overflow-wrap:\s*normal;", css)
    for page in nav_pages():
        html = (site / url_of(page) / "index.html").read_text(encoding="utf-8")
        assert "stylesheets/extra.css" in html, f"docs/{page} does not load stylesheets/extra.css"
