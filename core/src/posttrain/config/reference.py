"""The configuration reference: every key of core's sections and of every section a plugin
registers (``posttrain_config_sections``), with its type, default and documentation.

A key's documentation is read from the source of its attrs class, in this order: the
comment at the end of the field's line, the comment lines directly above the field, and an
entry ``name``: text in the class docstring (a ``- ``name``: ...`` bullet or inline).
Inherited fields are documented by the class that declares them. Types are written as the
config loader's error messages write them (:func:`posttrain.config.structure.type_name`).

:func:`reference_markdown` renders it all as Markdown (the documentation site's
configuration page is generated from it); :func:`config_sections` gives the same content as
data; :func:`annotated_config` writes a resolved config as YAML with each key's
documentation (``posttrain config show``).
"""

from __future__ import annotations

import functools
import inspect
import io
import json
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import yaml

from posttrain.config.schema import RunConfig
from posttrain.config.structure import LOADER_FIELDS, type_name
from posttrain.plugins import PluginHost, plugin_host

CORE_SOURCE = "posttrain (core)"


@attrs.frozen
class KeyDoc:
    """One key: its dotted path, type, default (as YAML would write it) and documentation.

    ``section`` is the dotted path under which the keys of its value are listed, when its
    value is a section (``type`` is then ``"section"`` and ``default`` empty) or may be
    written as a mapping of keys (e.g. ``data.train``: a path, or ``{name, split, ...}``);
    otherwise None."""

    path: str
    type: str
    default: str
    doc: str
    section: str | None = None


@attrs.frozen
class SectionDoc:
    """One section: its dotted path ("" for the top level), its class, who registers it,
    the class's own description and its keys in declaration order."""

    path: str
    class_name: str
    source: str
    summary: str
    keys: tuple[KeyDoc, ...]


def config_sections(host: PluginHost | None = None) -> list[SectionDoc]:
    """Core's sections and every registered plugin section, each followed by its nested
    sections; a plugin section comes right after the section it sits in (``policy.dtensor``
    after ``policy`` and its own subsections), top-level plugin sections last, by name.
    The top level and each section list the plugin sections registered inside them as keys."""
    host = host if host is not None else plugin_host()
    registry = host.config_sections
    plugin_paths = sorted(registry)
    children: dict[str, list[str]] = {}
    for path in plugin_paths:
        parent = path.rpartition(".")[0]
        children.setdefault(parent, []).append(path)

    out: list[SectionDoc] = []

    def add(cls: type, path: str, source: str, exclude: frozenset[str] = frozenset()) -> None:
        own = list(_field_keys(cls, path, exclude))
        plugged = [(_section_key(child, registry.distribution_of(child)), registry[child]) for child in children.get(path, [])]
        out.append(SectionDoc(path, cls.__name__, source, _summary(cls), tuple(key for key, _ in [*own, *plugged])))
        for key, nested in own:
            if nested is not None:
                add(nested, key.path, source)
        for key, nested in plugged:
            add(nested, key.path, registry.distribution_of(key.path))

    add(RunConfig, "", CORE_SOURCE, exclude=LOADER_FIELDS)
    done = {section.path for section in out}
    for path in plugin_paths:  # under a parent that is no section: unreachable from YAML, listed anyway
        if path not in done:
            add(registry[path], path, registry.distribution_of(path))
            done |= {section.path for section in out}
    return out


def reference_markdown(host: PluginHost | None = None, *, heading_level: int = 2) -> str:
    """:func:`config_sections` as Markdown: one heading per section (its id is the dotted
    path, ``top-level`` for the top level), the section's description and a table of its
    keys. Each plain key's row carries an anchor named by its dotted path."""
    parts = []
    for section in config_sections(host):
        parts.append(section_markdown(section, heading_level))
    return "\n\n".join(parts) + "\n"


def section_markdown(section: SectionDoc, heading_level: int = 2) -> str:
    """One section as Markdown (see :func:`reference_markdown`)."""
    anchor = section.path or "top-level"
    title = f"`{section.path}`" if section.path else "Top level"
    origin = "core" if section.source == CORE_SOURCE else f"plugin `{section.source}`"
    intro = f"*{section.class_name}, from {origin}.*" + (f" {section.summary}" if section.summary else "")
    return "\n".join([f"{'#' * heading_level} {title} {{#{anchor}}}", "", intro, "", *_table(section.keys)])


def annotated_config(config: RunConfig, host: PluginHost | None = None) -> str:
    """``config`` as YAML: every key of the sections its run reads, in the reference's
    order, with its value and a comment holding its documentation and, when the value was
    not a default, where it was set (file and line, or the override).

    Plugin sections a run of ``config.algorithm`` does not read are left out: another
    algorithm's top-level section (``dpo`` in a GRPO run; unless the running algorithm's
    section names it in ``reads_sections``, as ``ppo`` names ``grpo``), and a backend section beside a
    ``backend`` key that names another backend (``policy.megatron`` when ``policy.backend``
    is dtensor). Values are written in YAML's flow style, one key a line."""
    host = host if host is not None else plugin_host()
    sections = {section.path: section for section in config_sections(host)}
    read_too = getattr(config.sections.get(config.algorithm or ""), "reads_sections", ())
    other_algorithms = set(host.algorithms) - {config.algorithm} - set(read_too)
    rows: list[tuple[str, str]] = []  # (indented "key: value", comment)

    def read(owner: Any, key: KeyDoc) -> Any:
        if key.path in config.sections:
            return config.sections[key.path]
        alias = key.path.rpartition(".")[2]
        return getattr(owner, next(field.name for field in attrs.fields(type(owner)) if field.alias == alias))

    def read_by_run(owner: Any, key: KeyDoc) -> bool:
        parent, _, name = key.path.rpartition(".")
        if key.path not in config.sections:
            return True
        if not parent:
            return name not in other_algorithms
        return getattr(owner, "backend", name) == name

    def add(path: str, owner: Any, depth: int) -> None:
        for key in sections[path].keys:
            if not read_by_run(owner, key):
                continue
            value = read(owner, key)
            name = "  " * depth + key.path.rpartition(".")[2]
            where = config.sources.get(key.path)
            comment = " ".join(filter(None, [key.doc, f"(set at {where})" if where else ""]))
            if attrs.has(type(value)) and key.path in sections:
                rows.append((f"{name}:", comment))
                add(key.path, value, depth + 1)
            else:
                rows.append((f"{name}: {_flow_yaml(value)}", comment))

    add("", config, 0)
    width = max((len(text) for text, _ in rows if len(text) <= 48), default=0)
    return "".join(f"{text.ljust(width)}  # {comment}\n" if comment else f"{text}\n" for text, comment in rows)


def _flow_yaml(value: Any) -> str:
    """A value as YAML on one line (flow style): ``null``, ``0.003``, ``[0.9, 0.999]``, ``{a: 1}``."""
    plain = json.loads(json.dumps(attrs.asdict(value) if attrs.has(type(value)) else value, default=str))
    text = yaml.safe_dump(plain, default_flow_style=True, width=2**31, allow_unicode=True, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def options_markdown(cls: type, prefix: str) -> str:
    """The table of the fields of an attrs options class whose keys live under ``prefix``
    (e.g. an environment's options under ``environments.math``), as in a section."""
    return "\n".join(_table(option_keys(cls, prefix)))


def option_keys(cls: type, prefix: str) -> list[KeyDoc]:
    """The keys of an attrs options class whose keys live under ``prefix``, as
    :func:`options_markdown` lists them."""
    return [key for key, _ in _field_keys(cls, prefix, frozenset())]


def _table(keys: Sequence[KeyDoc]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key in keys:
        if key.section is not None:  # its keys are listed under a heading with this id
            name = f"[`{key.path}`](#{key.section})"
        else:
            name = f'<a id="{key.path}"></a>`{key.path}`'
        kind = _cell(key.type)
        default = f"`{_cell(key.default)}`" if key.default else ""
        lines.append(f"| {name} | {kind} | {default} | {_cell(key.doc)} |")
    return lines


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: documentation}`` of an attrs class (see the module docstring for where
    it is read); fields without documentation are left out."""
    docs: dict[str, str] = {}
    names = [field.name for field in attrs.fields(cls)]
    for klass in cls.__mro__:
        if not attrs.has(klass):
            continue
        own = {**_docstring_entries(klass, names), **_comments(klass)}
        for name, text in own.items():
            docs.setdefault(name, text)
    return {name: docs[name] for name in names if name in docs}


# --------------------------------------------------------------------------- fields


def _field_keys(cls: type, path: str, exclude: frozenset[str]) -> Iterator[tuple[KeyDoc, type | None]]:
    """Each init field of ``cls`` as a key under ``path``, with the attrs class whose keys
    its value may hold (a section, or a mapping form such as ``str | DataSource``)."""
    docs = field_docs(cls)
    hints = _hints(cls)
    for field in attrs.fields(cls):
        if not field.init or field.name in exclude:
            continue
        key = f"{path}.{field.alias}" if path else field.alias
        hint = hints.get(field.name, Any)
        doc = _markdown(docs.get(field.name, ""))
        if attrs.has(hint):
            yield KeyDoc(key, "section", "", doc, section=key), hint
            continue
        mapping = _mapping_class(hint)
        yield KeyDoc(key, type_name(hint), _default(field), doc, section=key if mapping else None), mapping


def _mapping_class(hint: Any) -> type | None:
    """The attrs class among the members of a union annotation, if there is exactly one."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    classes = [arg for arg in typing.get_args(hint) if attrs.has(arg)]
    return classes[0] if len(classes) == 1 else None


def _section_key(path: str, source: str) -> KeyDoc:
    return KeyDoc(path, "section", "", f"Registered by plugin `{source}`.", section=path)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _default(field: attrs.Attribute) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory(None) if default.takes_self else default.factory()
    return _yaml_value(default)


def _yaml_value(value: Any) -> str:
    """A default as a YAML reader would write it: ``null``, ``true``, ``1.0e-05``, ``"sdpa"``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    return json.dumps(value, default=str)


# --------------------------------------------------------------------------- documentation


def _summary(cls: type) -> str:
    """The class docstring without its per-field entries."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    if not doc:
        return ""
    names = [field.name for field in attrs.fields(cls)]
    first = _entry_pattern(names).search(doc)
    text = doc[: first.start()] if first else doc
    return _markdown(_join(text.rstrip().removesuffix("-")))


def _docstring_entries(cls: type, names: list[str]) -> dict[str, str]:
    """``{name: text}`` for each ````name``:`` entry of ``cls``'s own docstring."""
    doc = cls.__dict__.get("__doc__") or ""
    doc = inspect.cleandoc(doc)
    matches = list(_entry_pattern(names).finditer(doc))
    out: dict[str, str] = {}
    if not matches:
        return out
    ends = [match.start() for match in matches[1:]] + [len(doc)]
    for match, end in zip(matches, ends, strict=True):
        text = doc[match.end(): end]
        text = _join(text).removesuffix("-").strip().removesuffix(";").strip()
        out.setdefault(match.group(1), text)
    return out


def _entry_pattern(names: list[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True)) or "(?!)"
    return re.compile(rf"``({alternatives})``:\s*")


def _comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from ``cls``'s source: the comment ending a field's line, after
    the comment lines directly above it (no blank line between)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a class defined without a source file
        return {}
    out: dict[str, str] = {}
    depth = 0
    above: list[str] = []  # comment lines since the last statement or blank line
    line: list[tokenize.TokenInfo] = []  # tokens of the current logical line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.INDENT:
            depth += 1
        elif token.type == tokenize.DEDENT:
            depth -= 1
        elif token.type == tokenize.NL:
            if not line:  # a line holding only a comment, or a blank line
                if not _is_comment_line(token):
                    above = []
            continue
        elif token.type == tokenize.COMMENT and not line:
            above.append(_strip_comment(token.string))
        elif token.type == tokenize.NEWLINE:
            name = _field_name(line) if depth == 1 else None
            if name is not None:
                trailing = [_strip_comment(t.string) for t in line if t.type == tokenize.COMMENT]
                text = " ".join([*above, *trailing]).strip()
                if text:
                    out[name] = text
            above, line = [], []
        else:
            line.append(token)
    return out


def _is_comment_line(nl: tokenize.TokenInfo) -> bool:
    return nl.line.strip().startswith("#")


def _field_name(tokens: list[tokenize.TokenInfo]) -> str | None:
    """The name of a class-body line ``name: annotation ...``, or None for other lines."""
    code = [t for t in tokens if t.type != tokenize.COMMENT]
    if len(code) >= 2 and code[0].type == tokenize.NAME and code[1].string == ":":
        return code[0].string
    return None


def _strip_comment(text: str) -> str:
    return text.lstrip("#").strip()


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def _markdown(text: str) -> str:
    """reStructuredText inline markup as Markdown: ````x```` and ``:class:`~a.B``` as code."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return text.replace("``", "`")


def _join(text: str) -> str:
    """Text on one line, runs of whitespace collapsed."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return re.sub(r"\s+", " ", " ".join(line for line in lines if line)).strip()


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped, and ``<`` / ``>`` outside code
    spans written as entities (``<run_dir>`` is text, not an HTML tag)."""
    parts = _CODE_SPAN.split(text.replace("\n", " "))
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts).replace("|", "\\|")
