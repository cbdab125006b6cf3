"""Structure a resolved plain config tree into :class:`RunConfig` and plugin sections.

A small generic structurer for attrs classes whose fields are annotated with: nested attrs
classes, ``X | None`` (and other unions), ``list[T]``, ``dict[str, T]``, ``Literal[...]``,
``Any``, ``int``, ``float``, ``bool``, ``str``. Rules: an int is accepted where a float is expected (and
becomes a float); a bool is never an int or a float; strings are never turned into numbers;
an absent field takes its class default; a section written as an empty key (``logger:``)
takes all its defaults.

Key paths are tuples of strings; a list item is written ``"[i]"``. ``sources`` maps each
mapping key path to where its value was set (``"exp.yaml:7"``, or the command-line
override), and every error about a key names it.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import attrs

from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError, PluginError, did_you_mean
from posttrain.plugins import Registry

KeyPath = tuple[str, ...]
Sources = Mapping[KeyPath, str]

#: RunConfig fields the loader fills itself; never read from YAML.
LOADER_FIELDS = frozenset({"sections", "raw", "sources"})

_SCALARS = (int, float, bool, str)
_NONE = type(None)


def dotted(path: KeyPath) -> str:
    """``("policy", "optimizer", "lr")`` -> ``"policy.optimizer.lr"``; list items as ``[i]``."""
    out = ""
    for part in path:
        out += part if part.startswith("[") or not out else "." + part
    return out


def source_of(sources: Sources, path: KeyPath) -> str | None:
    """Where the value at ``path`` was set: its own entry, else its nearest recorded parent's."""
    keys = list(path)
    while keys and keys[-1].startswith("["):  # list items share their list's source
        keys.pop()
    for end in range(len(keys), 0, -1):
        found = sources.get(tuple(keys[:end]))
        if found is not None:
            return found
    return None


def at(sources: Sources, path: KeyPath) -> str:
    """``" (at exp.yaml:7)"``, or ``""`` when the key's origin is unknown."""
    where = source_of(sources, path)
    return f" (at {where})" if where else ""


def type_name(tp: Any) -> str:
    """A reader's name for an annotation: ``float or null``, ``list[str]``, ``mapping (X)``."""
    if tp is Any:
        return "any value"
    if tp is _NONE:
        return "null"
    if attrs.has(tp):
        return f"mapping ({tp.__name__})"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (list, dict) and args:
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"
    return getattr(tp, "__name__", repr(tp))


def describe(value: Any) -> str:
    """``str 'abc'``, ``bool True``, ``null``: the found value as an error message shows it."""
    if value is None:
        return "null"
    kind = "mapping" if isinstance(value, Mapping) else type(value).__name__
    text = repr(value)
    return f"{kind} {text if len(text) <= 80 else text[:77] + '...'}"


def structure_run_config(data: Mapping[Any, Any], sources: Sources, sections: Registry) -> RunConfig:
    """Build a :class:`RunConfig` from a resolved tree.

    A key that is not a field of its class but whose dotted path is registered in
    ``sections`` is structured into the registered class and stored in
    ``RunConfig.sections``; registered sections absent from ``data`` get default instances
    when their class needs no arguments. ``raw`` receives ``data``, ``sources`` the dotted
    form of ``sources``. Raises :class:`ConfigError` naming the key and where it was set.
    """
    for name in sections:
        if not attrs.has(sections[name]):
            raise PluginError(
                f"config section '{name}' ({sections.distribution_of(name)}) must be an attrs class, "
                f"got {sections[name]!r}"
            )
    structurer = _Structurer(sources, sections)
    config = structurer.instance(data, RunConfig, (), exclude=LOADER_FIELDS)
    for name in sections:
        cls = sections[name]
        if name not in structurer.sections and all(has_default for _, has_default in _fields(cls).values()):
            structurer.sections[name] = cls()
    return attrs.evolve(
        config,
        sections=structurer.sections,
        raw=dict(data),
        sources={dotted(path): where for path, where in sources.items()},
    )


def structure_value(value: Any, tp: Any, path: KeyPath, sources: Sources) -> Any:
    """``value`` (plain YAML data) as type ``tp``, checked as the loader checks a config key at
    ``path`` (messages name the key and where it was set)."""
    return _Structurer(sources, Registry("config section", {})).value(value, tp, path)


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """``{init name: (resolved annotation, has a default)}`` of an attrs class."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # a forward reference the class's module cannot resolve
        raise PluginError(
            f"cannot resolve the type annotations of {cls.__module__}.{cls.__qualname__}: {exc}. "
            "Config classes must be importable at module level."
        ) from exc
    return {
        field.alias: (hints.get(field.name, Any), field.default is not attrs.NOTHING)
        for field in attrs.fields(cls)
        if field.init
    }


def _fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` has the right shape for ``tp`` (checked one level deep)."""
    if tp is Any:
        return True
    if tp is _NONE:
        return value is None
    if tp is bool or tp is str:
        return isinstance(value, tp)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(tp))
    if origin is Literal:  # True is not 1 here
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(tp))
    if attrs.has(tp) or tp is dict or origin is dict:
        return isinstance(value, Mapping)
    if tp is list or origin is list:
        return isinstance(value, list)
    return False


def _literals(tp: Any) -> list[Any]:
    """The allowed values of a ``Literal`` annotation, also inside ``Literal[...] | None``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return list(args)
    if origin in (Union, types.UnionType):
        return [value for arg in args for value in _literals(arg)]
    return []


class _Structurer:
    def __init__(self, sources: Sources, registry: Registry):
        self.sources = sources
        self.registry = registry
        self.sections: dict[str, Any] = {}
        # Registered sections by the key path of their parent level: {("policy",): {"dtensor": "policy.dtensor"}}.
        self.children: dict[KeyPath, dict[str, str]] = {}
        for name in registry:
            *parent, last = name.split(".")
            self.children.setdefault(tuple(parent), {})[last] = name

    def mismatch(self, value: Any, tp: Any, path: KeyPath) -> ConfigError:
        choices = [arg for arg in _literals(tp) if isinstance(arg, str)]
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        return ConfigError(
            f"config key '{dotted(path)}'{at(self.sources, path)}: expected {type_name(tp)}, "
            f"found {describe(value)}{'.' + hint if hint else ''}"
        )

    def value(self, value: Any, tp: Any, path: KeyPath) -> Any:
        """Structure one value against one annotation."""
        if tp is Any:
            return value
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (Union, types.UnionType):
            if value is None and _NONE in args:
                return None
            for arg in args:
                if arg is not _NONE and _fits(value, arg):
                    return self.value(value, arg, path)
            raise self.mismatch(value, tp, path)
        if attrs.has(tp):
            return self.instance(value, tp, path)
        if tp is list or origin is list:
            if not isinstance(value, list):
                raise self.mismatch(value, tp, path)
            item_tp = args[0] if args else Any
            return [self.value(item, item_tp, (*path, f"[{i}]")) for i, item in enumerate(value)]
        if tp is dict or origin is dict:
            if not isinstance(value, Mapping):
                raise self.mismatch(value, tp, path)
            key_tp, item_tp = args or (Any, Any)
            out = {}
            for key, item in value.items():
                sub = (*path, str(key))
                if key_tp is str and not isinstance(key, str):
                    raise ConfigError(
                        f"config key '{dotted(sub)}'{at(self.sources, sub)}: keys here must be strings, "
                        f"found {describe(key)}; quote it"
                    )
                out[key] = self.value(item, item_tp, sub)
            return out
        if tp in _SCALARS or origin is Literal:
            if not _fits(value, tp):
                raise self.mismatch(value, tp, path)
            return float(value) if tp is float else value
        raise PluginError(
            f"config key '{dotted(path)}': annotation {tp!r} is not supported by the config loader "
            "(use attrs classes, X | None, list[T], dict[str, T], Literal[...], Any, int, float, bool or str)"
        )

    def instance(self, value: Any, cls: type, path: KeyPath, exclude: frozenset[str] = frozenset()) -> Any:
        """Structure a mapping into attrs class ``cls``, routing registered sections aside."""
        if value is None:  # `logger:` with every key commented out: all defaults
            value = {}
        if not isinstance(value, Mapping):
            raise self.mismatch(value, cls, path)
        fields = {name: spec for name, spec in _fields(cls).items() if name not in exclude}
        here = self.children.get(path, {})
        kwargs = {}
        for key, item in value.items():
            sub = (*path, str(key))
            if key in fields:
                kwargs[key] = self.value(item, fields[key][0], sub)
            elif key in here:
                self.sections[here[key]] = self.instance(item, self.registry[here[key]], sub)
            else:
                raise self.unknown_key(sub, [*fields, *here])
        for name, (tp, has_default) in fields.items():
            if name not in kwargs and not has_default:
                key = dotted((*path, name))
                raise ConfigError(
                    f"missing config key '{key}' (expected {type_name(tp)}). "
                    f"Set it in the config file or on the command line: {key}=VALUE"
                )
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:  # the class's own validators
            raise ConfigError(f"config key '{dotted(path)}'{at(self.sources, path)}: {exc}") from exc

    def unknown_key(self, path: KeyPath, valid: list[str]) -> ConfigError:
        prefix = dotted(path[:-1]) + "." if len(path) > 1 else ""
        hint = did_you_mean(path[-1], valid, prefix=prefix)
        if not hint:
            hint = f" Valid keys here: {', '.join(sorted(valid))}." if valid else " No keys are valid here."
        return ConfigError(f"unknown config key '{dotted(path)}'{at(self.sources, path)}.{hint}")
