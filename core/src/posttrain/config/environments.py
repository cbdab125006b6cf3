"""Environment options: the mapping under ``environments.<name>``, read like a config section.

Two kinds of key live there:

- core's own (:class:`CoreEnvironmentOptions`: ``call_timeout_s``, ``call_retries``,
  ``max_failed_fraction``, ``in_driver``): accepted under every environment, read by core and never passed
  to the environment;
- the environment's own, declared once, on its factory, as an attrs class:
  ``@environment_options(MathOptions)``. They are read the way the loader reads a plugin
  section: types from the annotations (``int``, ``float``, ``X | None``, ``Literal[...]``,
  nested attrs classes...), then the class's attrs validators; an unknown key is refused
  with a did-you-mean suggestion (core's keys count as known). Every error names the key
  and, when the loader recorded it, the file and line where it was set.

A factory that declares no class receives the mapping (core's keys removed) unchecked.

A factory may also declare the per-sample metadata keys it cannot score without
(:func:`requires_metadata`), each with what it holds; the run checks every data row of the
environment for them while the data is read, before Ray starts
(:func:`posttrain.run.environments.environment_names`).

The config check (:func:`posttrain.config.validate.validate_config`) reads the options of
every configured environment when the config is loaded, so a bad option fails before Ray or
any worker starts; the environment's actor reads them again to build it. Imports nothing
heavy: plugin modules import this at entry-point load.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from posttrain.config.structure import KeyPath, Sources, at, dotted, structure_value, type_name
from posttrain.errors import ConfigError, did_you_mean

T = TypeVar("T")


def above(bound: float) -> Callable[[Any, attrs.Attribute, Any], None]:
    """attrs validator: a number greater than ``bound`` (the type is the annotation's job)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (isinstance(value, (int, float)) and value > bound):
            raise ValueError(f"expected a number > {bound:g}, found {value!r}")

    return check


def at_least(minimum: float) -> Callable[[Any, attrs.Attribute, Any], None]:
    """attrs validator: a number of at least ``minimum``."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (isinstance(value, (int, float)) and value >= minimum):
            raise ValueError(f"expected a number >= {minimum:g}, found {value!r}")

    return check


def fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: a number from 0 to 1."""
    if not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ValueError(f"expected a fraction from 0 to 1, found {value!r}")


@attrs.frozen
class CoreEnvironmentOptions:
    """Keys core reads under every ``environments.<name>``; never passed to the environment,
    so an environment cannot declare an option of these names."""

    # seconds one call to the environment (a turn's step, its metrics) may take; past it the environment's
    # actor is stopped and the call made again on a fresh one (call_retries)
    call_timeout_s: float = attrs.field(default=600.0, validator=above(0))
    # times a call is made again, each on a fresh actor, after its actor died or passed call_timeout_s (in all,
    # per turn of a rollout); samples still unscored after them are left out of the loss (env/<name>/errors, timeouts)
    call_retries: int = attrs.field(default=2, validator=at_least(0))
    # the largest share of a rollout's samples of this environment that may be left unscored (0 to 1); more stops
    # the run, naming the environment, the first failed row and the error
    max_failed_fraction: float = attrs.field(default=0.5, validator=fraction)
    # run the environment in the driver's process instead of a Ray actor of its own; null: where its factory
    # declares it light (runs_in_driver: its work is small, or isolated in processes of its own)
    in_driver: bool | None = None


CORE_KEYS = tuple(field.name for field in attrs.fields(CoreEnvironmentOptions))


def environment_options(options_class: type[T]) -> Callable[[Callable[[T], Any]], Callable[[Any], Any]]:
    """Declare the options of an environment factory, once, as an attrs class::

        @environment_options(MathOptions)
        def math_environment(options: MathOptions) -> MathEnvironment: ...

    The decorated factory receives an instance of ``options_class``. Called with a mapping
    (the registry protocol: ``factory(options)``), it reads the mapping first, as
    :func:`read_options` does, naming keys by the class (``MathOptions.timout_s``); core
    reads a run's options by the environment's name before calling it.
    """
    if not attrs.has(options_class):
        raise TypeError(f"environment_options() takes an attrs class, got {options_class!r}")
    clash = [name for name in CORE_KEYS if name in attrs.fields_dict(options_class)]
    if clash:
        raise TypeError(f"{options_class.__qualname__} declares {', '.join(clash)}, which core reads itself")

    def declare(build: Callable[[T], Any]) -> Callable[[Any], Any]:
        @functools.wraps(build)
        def factory(options: Any) -> Any:
            if not isinstance(options, options_class):
                options = read_options(options_class, options, (options_class.__name__,))
            return build(options)

        factory.options_class = options_class  # type: ignore[attr-defined]
        return factory

    return declare


def declared_options(factory: Any) -> type | None:
    """The options class a factory declared with :func:`environment_options`, or None."""
    return getattr(factory, "options_class", None)


def requires_metadata(**keys: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the metadata keys an environment cannot score a sample without, each with a
    short description of what it holds::

        @requires_metadata(target="the integer the model must guess")
        @environment_options(GuessNumberOptions)
        def guess_number_environment(options): ...

    A row's metadata is its ``metadata`` object with its other keys, and ``answer`` when the
    row has one (see :mod:`posttrain.data.formats`). Every row of the environment is checked
    for non-null values under these keys before the run starts."""

    def declare(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.required_metadata = dict(keys)  # type: ignore[attr-defined]
        return factory

    return declare


def runs_in_driver(factory: Callable[..., Any]) -> Callable[..., Any]:
    """Declare an environment light enough to run in the run's driver process by default
    (``environments.<name>.in_driver`` left null): its calls do little work of their own, or
    send it to processes of their own (the ``math`` verifier's deadline pool). The driver
    then calls it on a thread of its own, one call at a time, and a call past
    ``call_timeout_s`` is left behind and the environment built afresh, as an actor would be."""
    factory.runs_in_driver = True  # type: ignore[attr-defined]
    return factory


def declares_runs_in_driver(factory: Any) -> bool:
    """Whether a factory was declared with :func:`runs_in_driver`."""
    return getattr(factory, "runs_in_driver", False) is True


def required_metadata(factory: Any) -> dict[str, str]:
    """The metadata keys (and their descriptions) a factory declared with :func:`requires_metadata`."""
    return dict(getattr(factory, "required_metadata", {}))


@attrs.frozen
class EnvironmentOptions:
    """One environment's options as read: core's, and the environment's own (an instance of
    its declared class, or the mapping when it declares none)."""

    core: CoreEnvironmentOptions
    own: Any


def read_environment_options(
    name: str, factory: Any, options: Mapping[str, Any] | None, sources: Sources | None = None
) -> EnvironmentOptions:
    """Read ``environments.<name>`` for the environment built by ``factory``.

    ``sources`` maps key paths to where they were set (as the loader records them) for the
    messages. Raises :class:`ConfigError` naming the key, what was expected and what was found.
    """
    core, rest = read_core_options(name, options, sources)
    options_class = declared_options(factory)
    if options_class is None:
        return EnvironmentOptions(core, rest)
    own = read_options(options_class, rest, ("environments", name), sources, also_known=CORE_KEYS)
    return EnvironmentOptions(core, own)


def read_core_options(
    name: str, options: Mapping[str, Any] | None, sources: Sources | None = None
) -> tuple[CoreEnvironmentOptions, dict[str, Any]]:
    """Core's keys of ``environments.<name>`` read, and the environment's own keys as given."""
    path = ("environments", name)
    sources = sources or {}
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"config key '{dotted(path)}'{at(sources, path)}: expected a mapping of options, found "
            f"{type(options).__name__} {options!r}; write e.g. '{dotted(path)}: {{}}' for the defaults"
        )
    core = {key: value for key, value in options.items() if key in CORE_KEYS}
    rest = {key: value for key, value in options.items() if key not in CORE_KEYS}
    return read_options(CoreEnvironmentOptions, core, path, sources), rest


def read_options(
    cls: type[T],
    options: Mapping[str, Any],
    path: KeyPath,
    sources: Sources | None = None,
    *,
    also_known: tuple[str, ...] = (),
) -> T:
    """``cls`` from the mapping ``options`` found at the key path ``path``: unknown keys
    (other than ``also_known``) refused with a suggestion, values structured by their
    annotations, then each field's validator run; errors name the key of the field."""
    sources = sources or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"config key '{dotted(path)}'{at(sources, path)}: expected a mapping, found {options!r}")
    fields = {field.alias: field for field in attrs.fields(cls) if field.init}
    for key in options:
        if key not in fields:
            raise _unknown_key((*path, str(key)), [*fields, *also_known], sources)
    hints = typing.get_type_hints(cls)
    values = {key: structure_value(item, hints.get(fields[key].name, Any), (*path, key), sources)
              for key, item in options.items()}
    for key, field in fields.items():
        if key not in values and field.default is attrs.NOTHING:
            raise ConfigError(
                f"missing config key '{dotted((*path, key))}' (expected {type_name(hints.get(field.name, Any))}); "
                f"set it under {dotted(path)}"
            )
        if key in values and field.validator is not None:
            try:
                field.validator(None, field, values[key])
            except (TypeError, ValueError) as exc:
                key_path = (*path, key)
                raise ConfigError(f"config key '{dotted(key_path)}'{at(sources, key_path)}: {exc}") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # checks across fields (__attrs_post_init__)
        raise ConfigError(f"config key '{dotted(path)}'{at(sources, path)}: {exc}") from None


def _unknown_key(path: KeyPath, valid: list[str], sources: Sources) -> ConfigError:
    prefix = dotted(path[:-1]) + "."
    hint = did_you_mean(path[-1], valid, prefix=prefix) or f" Valid keys here: {', '.join(sorted(valid))}."
    return ConfigError(f"unknown config key '{dotted(path)}'{at(sources, path)}.{hint}")
