"""Load a run's configuration: YAML files with inheritance, overrides, interpolation.

Order of operations (each step sees the result of the previous one):

1. The file is read; a top-level ``defaults:`` key (a path or a list of paths, relative to
   the file naming them) loads parent files first, recursively. Parents merge in list
   order, then the file itself: mappings merge key by key, anything else (lists, scalars)
   is replaced by the later value.
2. Command-line overrides ``a.b.c=value`` are applied in order; the value is read as YAML
   (``lr=1e-5``, ``stop=[a,b]``, ``x=null``; ``x=`` is the empty string).
3. ``${a.b}`` and ``${oc.env:VAR,default}`` interpolations are resolved by OmegaConf, so an
   override changes every value interpolated from it.
4. The tree is structured into :class:`RunConfig` (:mod:`posttrain.config.structure`) and
   validated (:mod:`posttrain.config.validate`).

Scalars follow YAML 1.2 rather than PyYAML's 1.1: ``1e-5`` is a float, only
``true``/``false`` are booleans (``yes``/``no``/``on``/``off`` stay strings), and dates,
octal ``012`` and sexagesimal ``1:30`` stay strings. Each mapping key remembers where it was
set (``file.yaml:LINE`` or ``command line override 'a.b=c'``) for error messages.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config.schema import RunConfig
from posttrain.config.structure import LOADER_FIELDS, KeyPath, at, describe, dotted, structure_run_config
from posttrain.config.validate import validate_config
from posttrain.errors import ConfigError
from posttrain.plugins import PluginHost, plugin_host

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_YAML12_SCALARS = [
    ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF"),
    ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
            |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        "-+0123456789.",
    ),
]
_REPLACED_TAGS = {tag for tag, _, _ in _YAML12_SCALARS} | {"tag:yaml.org,2002:timestamp"}


def _resolvers(base: dict[str, list[Any]], drop: set[str]) -> dict[str, list[Any]]:
    table = {first: [(tag, rx) for tag, rx in entries if tag not in drop] for first, entries in base.items()}
    for tag, rx, firsts in _YAML12_SCALARS:
        for first in firsts:
            table.setdefault(first, []).append((tag, rx))
    return table


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars (see the module docstring)."""

    yaml_implicit_resolvers = _resolvers(yaml.SafeLoader.yaml_implicit_resolvers, drop=_REPLACED_TAGS)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes every string YAML 1.1 *or* :class:`_Loader` would read otherwise."""

    yaml_implicit_resolvers = _resolvers(yaml.SafeDumper.yaml_implicit_resolvers, drop=set())


Sources = dict[KeyPath, str]


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, host: PluginHost | None = None) -> RunConfig:
    """Read ``path`` (or start from an empty config when None), apply ``overrides``, resolve
    interpolations, structure and validate. ``host`` defaults to this process's plugin host.

    Raises :class:`ConfigError` naming the file and line (or the override) of a bad key.
    """
    if path is None:
        data: dict[Any, Any] = {}
        sources: Sources = {}
    else:
        data, sources = _load_file(os.fspath(path), chain=(), named_at=None)
    return _finish(data, sources, overrides, host)


def config_from_dict(
    data: Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    host: PluginHost | None = None,
    source: str = "<dict>",
) -> RunConfig:
    """Like :func:`load_config` for a tree built in code; errors say ``(at <source>)``.
    ``data`` is not modified and ``defaults:`` is not processed."""
    tree = copy.deepcopy(dict(data))
    sources: Sources = {}
    _label(tree, (), source, sources)
    return _finish(tree, sources, overrides, host)


def dump_config(config: RunConfig) -> str:
    """The config as YAML, every field written out and plugin sections at their paths, such
    that :func:`load_config` reads it back to an equal config."""
    loader_owned = [getattr(attrs.fields(RunConfig), name) for name in LOADER_FIELDS]
    tree = attrs.asdict(config, filter=lambda field, _: all(field is not owned for owned in loader_owned))
    for name in sorted(config.sections, key=lambda name: name.count(".")):
        section = config.sections[name]
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = attrs.asdict(section) if attrs.has(type(section)) else section
    return yaml.dump(_escape_interpolations(tree), Dumper=_Dumper, sort_keys=False, allow_unicode=True)


# --------------------------------------------------------------------------- steps


def _finish(data: dict[Any, Any], sources: Sources, overrides: Sequence[str], host: PluginHost | None) -> RunConfig:
    for text in overrides:
        _apply_override(data, sources, text)
    resolved = _interpolate(data, sources)
    host = host if host is not None else plugin_host()
    config = structure_run_config(resolved, sources, host.config_sections)
    validate_config(config, host)
    return config


def _load_file(display: str, chain: tuple[tuple[str, str], ...], named_at: str | None) -> tuple[dict, Sources]:
    """One file merged over its ``defaults`` parents. ``chain`` holds the (real path, shown
    path) of the files including this one, for cycle detection."""
    real = os.path.realpath(display)
    if any(real == seen for seen, _ in chain):
        cycle = " -> ".join([shown for _, shown in chain] + [display])
        raise ConfigError(
            f"config files inherit from each other in a cycle: {cycle}. Remove one of these 'defaults' entries."
        )
    data, sources = _read_yaml(display, named_at)
    parents = _default_paths(data.pop("defaults", None), display, sources)
    sources.pop(("defaults",), None)
    merged: dict[Any, Any] = {}
    merged_sources: Sources = {}
    for parent, parent_named_at in parents:
        parent_data, parent_sources = _load_file(parent, (*chain, (real, display)), parent_named_at)
        _merge_into(merged, merged_sources, parent_data, parent_sources, ())
    _merge_into(merged, merged_sources, data, sources, ())
    return merged, merged_sources


def _read_yaml(display: str, named_at: str | None) -> tuple[dict, Sources]:
    """Parse one file into a tree and the ``file:LINE`` of each mapping key."""
    named = f" (named in 'defaults' at {named_at})" if named_at else ""
    sources: Sources = {}
    try:
        with open(display, encoding="utf-8") as stream:
            loader = _Loader(stream)
            try:
                node = loader.get_single_node()
                if node is not None:
                    _check_duplicate_keys(loader, node, display, set())
                data = {} if node is None else _construct(loader, node, (), display, sources)
            finally:
                loader.dispose()
    except FileNotFoundError:
        raise ConfigError(f"config file '{display}' not found{named}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file '{display}'{named}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file '{display}' is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{display}': the top level must be a mapping of config keys, found {describe(data)}"
        )
    return data, sources


def _check_duplicate_keys(loader: _Loader, node: yaml.Node, display: str, seen: set[int]) -> None:
    """Refuse a key written twice in one mapping (PyYAML would keep the last silently).
    Runs before merge keys are expanded, which legitimately repeat keys."""
    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            _check_duplicate_keys(loader, value_node, display, seen)
            if key_node.tag == _MERGE_TAG:
                continue
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(
                    f"{display}:{line}: duplicate key '{key}' (first at line {first_line[key]}); remove one"
                )
            first_line[key] = line
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicate_keys(loader, item, display, seen)


def _construct(loader: _Loader, node: yaml.Node, path: KeyPath | None, display: str, sources: Sources) -> Any:
    """Build the Python value of ``node``, recording mapping keys' lines under ``path``
    (``None`` inside lists, whose items are not key paths)."""
    if isinstance(node, yaml.MappingNode) and node.tag == _MAP_TAG:
        loader.flatten_mapping(node)  # YAML merge keys (<<: *anchor); later entries win
        out = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            sub = None if path is None else (*path, str(key))
            if sub is not None:
                sources[sub] = f"{display}:{key_node.start_mark.line + 1}"
            out[key] = _construct(loader, value_node, sub, display, sources)
        return out
    if isinstance(node, yaml.SequenceNode) and node.tag == _SEQ_TAG:
        return [_construct(loader, item, None, display, sources) for item in node.value]
    return loader.construct_object(node, deep=True)


def _default_paths(value: Any, display: str, sources: Sources) -> list[tuple[str, str | None]]:
    """The parent files named by ``defaults``, as (path to open, where it was named)."""
    if value is None:
        return []
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries):
        raise ConfigError(
            f"config key 'defaults'{at(sources, ('defaults',))}: expected a path or a list of paths, "
            f"found {describe(value)}"
        )
    base = os.path.dirname(display)
    named_at = sources.get(("defaults",))
    return [(os.path.normpath(os.path.join(base, os.path.expanduser(entry))), named_at) for entry in entries]


def _merge_into(base: dict, base_sources: Sources, top: Mapping, top_sources: Sources, path: KeyPath) -> None:
    """Merge ``top`` into ``base`` in place: mappings recursively, anything else replaced."""
    for key, value in top.items():
        sub = (*path, str(key))
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            if sub in top_sources:
                base_sources[sub] = top_sources[sub]
            _merge_into(base[key], base_sources, value, top_sources, sub)
        else:
            base[key] = value
            _replace_sources(base_sources, top_sources, sub)


def _replace_sources(base_sources: Sources, top_sources: Sources, path: KeyPath) -> None:
    """Make ``base_sources`` at and under ``path`` equal to ``top_sources`` there."""

    def under(key: KeyPath) -> bool:
        return key[: len(path)] == path

    for key in [key for key in base_sources if under(key)]:
        del base_sources[key]
    base_sources.update({key: where for key, where in top_sources.items() if under(key)})


def _label(value: Any, path: KeyPath, where: str, sources: Sources) -> None:
    """Record ``where`` for every mapping key at and under ``path`` (not inside lists)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            sub = (*path, str(key))
            sources[sub] = where
            _label(item, sub, where, sources)


def _apply_override(data: dict, sources: Sources, text: str) -> None:
    """Set ``a.b.c=value`` in ``data``, creating missing (or null) mappings on the way."""
    key, sep, raw = text.partition("=")
    parts = tuple(part.strip() for part in key.split("."))
    if not sep or not all(parts):
        raise ConfigError(
            f"malformed override '{text}': expected the form key.path=value, e.g. policy.optimizer.lr=1e-5"
        )
    label = f"command line override '{text}'"
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"malformed override '{text}': the value is not valid YAML ({problem}). "
            "Quote a string value for the shell, e.g. 'key=\"a: b\"'"
        ) from None
    node = data
    for depth, part in enumerate(parts[:-1], start=1):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
            sources[parts[:depth]] = label
        elif not isinstance(child, dict):
            raise ConfigError(
                f"{label}: cannot set '{key}' because '{dotted(parts[:depth])}'{at(sources, parts[:depth])} "
                f"holds {describe(child)}, not a mapping"
            )
        node = child
    node[parts[-1]] = value
    _replace_sources(sources, {}, parts)
    sources[parts] = label
    _label(value, parts, label, sources)


def _interpolate(data: dict, sources: Sources) -> dict:
    """Resolve ``${...}`` with OmegaConf; errors name the key holding the interpolation."""
    try:
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        full_key = str(getattr(exc, "full_key", "") or "")
        reason = str(getattr(exc, "msg", exc)).split("\n")[0]
        if not full_key:
            raise ConfigError(f"cannot resolve the config: {reason}") from None
        path = tuple(re.findall(r"[^.\[\]]+", full_key))
        raise ConfigError(f"config key '{full_key}'{at(sources, path)}: {reason}") from None


def _escape_interpolations(value: Any) -> Any:
    """Escape ``${`` in resolved strings so reading the dump back does not interpolate again."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, Mapping):
        return {key: _escape_interpolations(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_escape_interpolations(item) for item in value]
    return value
