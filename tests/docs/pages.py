"""The site's pages and their fenced code blocks, as the documentation tests read them."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MKDOCS_YML = REPO / "mkdocs.yml"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_TITLE = re.compile(r"""title=(?:"([^"]*)"|'([^']*)'|(\S+))""")


@attrs.frozen
class Block:
    """One fenced code block: where it starts (the line of its opening fence, 1-based), its
    language (``""`` when none), its ``title="..."`` if any, and its text (dedented)."""

    page: str
    line: int
    language: str
    title: str | None
    text: str

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def nav_pages() -> list[str]:
    """The pages of ``mkdocs.yml``'s nav, in order, as paths relative to ``docs/``."""

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        return []

    config = yaml.load(MKDOCS_YML.read_text(encoding="utf-8"), Loader=_IgnoreTags)
    return walk(config["nav"])


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``docs/<page>``, in order."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        info = opening["info"].strip()
        body = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) and not closing["info"].strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        else:
            raise AssertionError(f"docs/{page}:{i + 1}: code block never closed")
        language = info.split()[0] if info and not info.startswith(("{", "title=")) else ""
        title = _TITLE.search(info)
        out.append(Block(page, i + 1, language, next(filter(None, title.groups())) if title else None, "\n".join(body) + "\n"))
        i = j + 1
    return out


class _IgnoreTags(yaml.SafeLoader):
    """Reads mkdocs.yml, whose ``!!python/name:`` style tags a safe loader would refuse."""


_IgnoreTags.add_multi_constructor("", lambda loader, suffix, node: None)
