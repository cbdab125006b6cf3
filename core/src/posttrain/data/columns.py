"""Column renames: from a dataset's column names to the row keys the formats read.

When the config sets renames (``data.columns``, or a source's own ``columns``), exactly those
apply, once checked: each names a column the dataset has and a row key
(:data:`~posttrain.data.formats.ROW_KEYS`), and no two columns end up under one key.
Otherwise the common layouts of :data:`LAYOUTS` are recognised: a column listed for a row
key stands in for it when the dataset has no column of that name and no ``messages``
column (conversations need no renames). Columns not renamed keep their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from posttrain.data.formats import ROW_KEYS
from posttrain.data.sources import RowSource
from posttrain.errors import ConfigError, did_you_mean

#: Columns recognised without renames, by dataset kind: {row key: columns that stand for it}.
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "sft": {"prompt": ("question", "problem"), "response": ("completion", "answer", "solution")},
    "preference": {"prompt": ("question",)},
    "prompt": {"prompt": ("question", "problem")},  # a reference 'answer' is already a prompt row's key
}


def plan_columns(source: RowSource, kind: str) -> dict[str, str]:
    """The renames ``{column: row key}`` for every row of ``source`` as ``kind`` data.

    Raises :class:`ConfigError` for renames that do not fit the dataset, and when a layout
    is ambiguous (two columns could stand for one key)."""
    if source.rename:
        return _checked(source)
    return _recognised(source, kind)


def rename_row(row: Mapping[str, Any], plan: Mapping[str, str]) -> dict[str, Any]:
    """``row`` with its keys renamed by ``plan``."""
    return {plan.get(name, name): value for name, value in row.items()}


def _checked(source: RowSource) -> dict[str, str]:
    where, columns = source.rename_key, source.columns
    owner: dict[str, str] = {}  # row key -> the column renamed to it
    for column, key in source.rename.items():
        if key not in ROW_KEYS:
            raise ConfigError(
                f"{where}: column '{column}' is mapped to '{key}', which no format reads; map columns to "
                f"{', '.join(ROW_KEYS)}.{did_you_mean(key, ROW_KEYS)}"
            )
        if column not in columns:
            shared = ""
            if source.key is not None and where == "data.columns":
                shared = f" (data.columns applies to every source; renames for {source.key} alone go in its own columns)"
            raise ConfigError(
                f"{where}: {source.label} has no column '{column}'; its columns: {', '.join(columns) or 'none'}."
                f"{did_you_mean(column, columns)}{shared}"
            )
        if key in owner:
            raise ConfigError(
                f"{where}: columns '{owner[key]}' and '{column}' are both mapped to '{key}'; map one column to each key"
            )
        owner[key] = column
    for key, column in owner.items():
        if key in columns and key not in source.rename:
            raise ConfigError(
                f"{where}: column '{column}' is mapped to '{key}', but {source.label} also has a column '{key}'; "
                f"map '{key}' to another key as well, or leave '{column}' out"
            )
    return dict(source.rename)


def _recognised(source: RowSource, kind: str) -> dict[str, str]:
    columns = set(source.columns)
    if "messages" in columns:
        return {}
    candidates = {
        key: [name for name in names if name in columns]
        for key, names in LAYOUTS[kind].items()
        if key not in columns
    }
    for key, found in candidates.items():
        if len(found) > 1:
            example = ", ".join(f"{names[0]}: {k}" for k, names in candidates.items() if names)
            quoted = " and ".join(f"'{name}'" for name in found)
            prefix = f"{source.key}: " if source.key else ""
            raise ConfigError(
                f"{prefix}{source.label} has columns {quoted}, each of which could be the {key}; "
                f"choose with data.columns, e.g. {{{example}}}"
            )
    return {found[0]: key for key, found in candidates.items() if found}
