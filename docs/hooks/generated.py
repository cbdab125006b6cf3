"""mkdocs hook: the parts of the site generated from posttrain's code at build time.

A page asks for generated Markdown with an HTML comment on a line of its own:

- ``<!-- posttrain:config-reference -->``: every key of core's config sections and of every
  section the installed plugins register (:func:`posttrain.config.reference.reference_markdown`,
  read through this environment's plugin host, so a newly installed plugin appears without
  editing any page);
- ``<!-- posttrain:options MODULE:CLASS PREFIX -->``: the table of an attrs options class
  whose keys live under ``PREFIX`` (e.g. an environment's options).

A directive that names something missing stops the build with the page and the directive.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

DIRECTIVE = re.compile(r"^<!-- posttrain:(?P<name>[\w-]+)(?P<args>(?: [^ >]+)*) -->$", re.MULTILINE)


def expand(markdown: str, where: str = "<page>") -> str:
    """``markdown`` with every directive replaced by what it generates."""
    from posttrain.config.reference import options_markdown, reference_markdown

    def replace(match: re.Match[str]) -> str:
        name, args = match.group("name"), match.group("args").split()
        if name == "config-reference" and not args:
            return reference_markdown()
        if name == "options" and len(args) == 2:
            module, _, attr = args[0].partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"{where}: {match.group(0)} names no importable class: {exc}") from None
            return options_markdown(cls, args[1])
        raise ValueError(
            f"{where}: unknown directive {match.group(0)}; use <!-- posttrain:config-reference --> or "
            "<!-- posttrain:options MODULE:CLASS PREFIX -->"
        )

    return DIRECTIVE.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri)
