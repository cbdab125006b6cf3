"""Where a dataset's rows come from, as ``data.train`` / ``data.validation`` name it.

:func:`open_source` turns a config value (a path, or a
:class:`~posttrain.config.schema.DataSource` mapping) into a :class:`RowSource`: the rows as
``(number, row)`` with 1-based numbers, the column names, the label messages name the data
by, the config key that named it and where that key was set, and the column renames the
config asks for.

- A JSON Lines, JSON or parquet file is read by :mod:`posttrain.data.files`, each row as written.
- A folder written by ``save_to_disk`` (it holds ``dataset_dict.json``, or ``state.json``
  for a single Dataset) is read with ``datasets.load_from_disk``.
- Any other folder is a dataset repository (data files, optionally a README declaring
  configs), and ``name`` a Hugging Face Hub dataset id: both are read with
  ``datasets.load_dataset``. Offline (``HF_HUB_OFFLINE=1``) a Hub dataset comes from the
  datasets cache, and one that is not there fails at once, saying how to get it.

The split taken from a dataset with several is ``split`` when set, else its only split,
else the split named like the key (``train`` for ``data.train``, ``validation`` for
``data.validation``); a missing split is an error that lists the ones there are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from posttrain.config.schema import DataSource
from posttrain.data.files import SUFFIXES, read_columns, read_rows
from posttrain.errors import ConfigError, DataError, did_you_mean
from posttrain.log import get_logger

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@attrs.frozen
class RowSource:
    """The rows of one dataset and how the config names them.

    ``label`` names the data in messages (a path, or e.g. ``Hub dataset openai/gsm8k (subset
    main, split train)``); ``key`` is the config key that chose it (None for a path given in
    code); ``set_at`` where that key was set (``exp.yaml:12``), when known; ``rename`` maps
    columns to row keys, as set under the config key ``rename_key``."""

    label: str
    columns: tuple[str, ...]
    read: Callable[[], Iterator[tuple[int, Any]]] = attrs.field(repr=False)
    key: str | None = None
    set_at: str | None = None
    rename: Mapping[str, str] = attrs.field(factory=dict)
    rename_key: str = "data.columns"
    folder: str | None = None  # a local file's folder: where relative image paths are read from

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self.read()

    @property
    def prefix(self) -> str:
        """``"data.train (at exp.yaml:12): "`` for messages; ``""`` for a path given in code."""
        if self.key is None:
            return ""
        return f"{self.key} (at {self.set_at}): " if self.set_at else f"{self.key}: "


def open_source(
    spec: str | os.PathLike[str] | DataSource,
    *,
    key: str | None = None,
    default_split: str = "train",
    columns: Mapping[str, str] | None = None,
    sources: Mapping[str, str] | None = None,
) -> RowSource:
    """Open ``spec``, a path or a DataSource, without reading its rows yet.

    ``key`` is the config key that names it (``data.train``) and ``sources`` where the config's
    keys were set (:attr:`RunConfig.sources`), for messages; ``default_split``
    the split taken from a dataset with several when ``split`` is unset; ``columns`` the
    renames that apply when ``spec`` sets none of its own (``data.columns``).

    Raises :class:`ConfigError` when the config names something that is not there (a Hub
    dataset that is neither cached nor reachable, a split, a subset) and :class:`DataError`
    for a path that does not exist or data the ``datasets`` library cannot read.
    """
    mapped = isinstance(spec, DataSource)
    source = spec if isinstance(spec, DataSource) else DataSource(path=os.fspath(spec))
    at = _Where(key, default_split, mapped, dict(sources or {}))
    if source.columns is not None:
        rename, rename_key = dict(source.columns), at.field("columns")
    else:
        rename, rename_key = dict(columns or {}), "data.columns"
    opened = _open_hub(source, at) if source.name is not None else _open_path(source, at)
    return attrs.evolve(opened, key=key, set_at=at.set_at(), rename=rename, rename_key=rename_key)


@attrs.frozen
class _Where:
    """How messages name the source's config keys."""

    key: str | None
    default_split: str
    mapped: bool  # the config wrote a mapping (so its fields can be named), not a plain path
    sources: dict[str, str]  # where each config key was set, dotted

    def field(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def set_at(self, name: str | None = None) -> str | None:
        """Where the key (or its field ``name``) was set, when the loader recorded it."""
        if self.key is None:
            return None
        return self.sources.get(self.field(name)) if name else self.sources.get(self.key)

    @property
    def prefix(self) -> str:
        return f"{self.key}: " if self.key else ""

    def how_to_set(self, name: str, value: str, source: DataSource) -> str:
        if self.mapped or self.key is None:
            return f"{self.field(name)}: {value}"
        return f"{self.key}: {{path: {source.path}, {name}: {value}}}"


def _open_path(source: DataSource, at: _Where) -> RowSource:
    assert source.path is not None
    if not source.path:
        key = at.field("path") if at.mapped else at.key or "path"
        raise ConfigError(f"{key} is empty; set it to a file or folder (or use name: org/dataset for a Hub dataset)")
    path = Path(source.path)
    if path.is_file():
        for name in ("subset", "split"):
            if getattr(source, name) is not None:
                raise ConfigError(
                    f"{at.field(name)}: {path} is a file, which has no {name}s ({name} applies to dataset folders "
                    "and Hub datasets); remove it"
                )
        return RowSource(str(path), read_columns(path), lambda: read_rows(path), folder=str(path.parent))
    if not path.is_dir():
        raise DataError(_missing(path, source, at))
    import datasets

    saved = (datasets.config.DATASETDICT_JSON_FILENAME, datasets.config.DATASET_STATE_JSON_FILENAME)
    if any((path / name).is_file() for name in saved):
        if source.subset is not None:
            raise ConfigError(f"{at.field('subset')}: {path} is a save_to_disk folder, which has no subsets; remove it")
        return _pick_split(datasets.load_from_disk(str(path)), source, at)
    return _pick_split(_load_dataset(str(path), source, at), source, at)


def _missing(path: Path, source: DataSource, at: _Where) -> str:
    """What a path that is not there says: the key, the absolute path tried and, for a
    relative path, what it was resolved against; a Hub id written as a path is pointed out."""
    key = (at.field("path") if at.mapped else at.key) if at.key else None
    where = at.set_at("path" if at.mapped else None)
    head = f"{key}{f' (at {where})' if where else ''}: " if key else ""
    message = f"{head}no such file or folder: {path.absolute()}"
    fix = "Fix the path"
    if not path.is_absolute():
        message += (
            f" ('{source.path}' is relative: relative data paths resolve against the current directory, "
            f"{Path.cwd()}, not the config file's folder)"
        )
        fix += ", or run from the folder it is relative to"
    if _HUB_ID.match(source.path or "") and path.suffix.lower() not in SUFFIXES:
        fix = f"For the Hub dataset '{source.path}', write {at.key or 'the source'}: {{name: {source.path}}}"
    return f"{message}. {fix}"


def _open_hub(source: DataSource, at: _Where) -> RowSource:
    assert source.name is not None
    name = Path(source.name)
    if name.exists():
        what = "folder" if name.is_dir() else "file"
        raise ConfigError(
            f"{at.field('name')}: '{source.name}' is a local {what}, but name is for Hub dataset ids; "
            f"use {at.field('path')}: {source.name}"
        )
    loaded = _load_dataset(source.name, source, at)
    if source.revision is not None and _offline():
        get_logger().warning(
            "offline: the cached copy of a Hub dataset is used whatever its revision", key=at.key,
            dataset=source.name, revision=source.revision,
        )
    return _pick_split(loaded, source, at)


def _load_dataset(target: str, source: DataSource, at: _Where) -> Any:
    """``datasets.load_dataset`` of every split, its failures as messages naming the config keys."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(target, source.subset, revision=source.revision)
    except ConnectionError as exc:
        offline = _offline()
        why = "offline mode is on (HF_HUB_OFFLINE=1)" if offline else f"the Hub cannot be reached ({exc})"
        again = "with network access (unset HF_HUB_OFFLINE)" if offline else "once the Hub can be reached"
        raise ConfigError(
            f"{at.prefix}{_describe(source)} is not in the local datasets cache ({datasets.config.HF_DATASETS_CACHE}) "
            f"and {why}. Load it once {again} to cache it, or download the repository (hf download {target} "
            f"--repo-type dataset --local-dir DIR) and set {at.key or 'the source'}: {{path: DIR}}"
        ) from None
    except DatasetNotFoundError as exc:
        raise ConfigError(
            f"{at.prefix}{exc} Check the id (and revision); a private or gated dataset needs a login (hf auth login)"
        ) from None
    except ValueError as exc:
        text = " ".join(str(exc).split())
        if "config" not in text.lower():
            raise
        raise ConfigError(f"{at.field('subset')}: {_describe(source)}: {text}") from None
    except FileNotFoundError as exc:  # a folder without data files, or files the builders cannot read
        raise DataError(f"{at.prefix}{_describe(source)}: {' '.join(str(exc).split())}") from None


def _pick_split(loaded: Any, source: DataSource, at: _Where) -> RowSource:
    """The chosen split of a DatasetDict (see the module docstring), or a single Dataset."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        if source.split is not None:
            raise ConfigError(
                f"{at.field('split')}: {_describe(source)} holds a single Dataset saved with save_to_disk, "
                "which has no splits; remove it"
            )
        return _rows(loaded, _describe(source))
    splits = list(loaded)
    available = ", ".join(splits) or "none"
    if source.split is not None:
        if source.split not in loaded:
            raise ConfigError(
                f"{at.field('split')}: {_describe(source)} has no split '{source.split}'; its splits: {available}."
                f"{did_you_mean(source.split, splits)}"
            )
        split = source.split
    elif len(splits) == 1:
        split = splits[0]
    elif at.default_split in loaded:
        split = at.default_split
    else:
        example = splits[0] if splits else "NAME"
        raise ConfigError(
            f"{at.prefix}{_describe(source)} has splits {available} and none is named '{at.default_split}'; "
            f"choose one: {at.how_to_set('split', example, source)}"
        )
    return _rows(loaded[split], _describe(source, split))


def _rows(dataset: Any, label: str) -> RowSource:
    plain = dataset.with_format(None)  # Python values, whatever format it was saved with
    return RowSource(label, tuple(plain.column_names), lambda: enumerate(plain, start=1))


def _offline() -> bool:
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


def _describe(source: DataSource, split: str | None = None) -> str:
    """``Hub dataset org/x (subset main, split train, revision v1)``, or the path with its details."""
    head = f"Hub dataset {source.name}" if source.name is not None else str(Path(str(source.path)))
    details = [f"{k} {v}" for k, v in (("subset", source.subset), ("split", split), ("revision", source.revision)) if v]
    return f"{head} ({', '.join(details)})" if details else head
