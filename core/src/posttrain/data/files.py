"""Read the rows of a local data file: JSON Lines, JSON or parquet, chosen by extension.

Rows come out as ``(number, value)``. ``number`` is 1-based: the line number for JSON Lines
(blank lines are skipped but still counted, so it matches an editor's line), the position
in the array for JSON and in the table for parquet. ``value`` is the parsed row, or an
:class:`Unparsable` when a JSON Lines line is not valid JSON, so the caller decides
whether that fails the run or is skipped.

JSON and JSON Lines are parsed with the standard library rather than through Arrow: Arrow
infers one schema for the whole file, which fills missing keys with nulls, adds every
message key seen anywhere to every message, and rejects a row of the wrong type with an
error that names no row. Parsing each row by itself keeps rows as written and lets errors
name the row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from posttrain.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")


@attrs.frozen
class Unparsable:
    """A row that could not be parsed; ``reason`` says why."""

    reason: str


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, row)`` for every row of ``path``; see the module docstring.

    Raises :class:`DataError` when the file is missing, has an unsupported extension, or
    is not a JSON array (for ``.json``).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file: {path.absolute()}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif suffix == ".json":
        yield from _json_rows(path)
    elif suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise DataError(f"{path}: unsupported file type '{path.suffix}'; use one of {', '.join(SUFFIXES)}")


def read_columns(path: str | Path) -> tuple[str, ...]:
    """The column names of a file: parquet's schema; for JSON and JSON Lines every key of
    any object row, in order of first appearance (one pass over the file)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return tuple(pq.ParquetFile(path).schema_arrow.names)
    seen: dict[str, None] = {}
    for _, row in read_rows(path):
        if isinstance(row, dict):
            seen.update(dict.fromkeys(row))
    return tuple(seen)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:  # without the line break, an error at the end of the line gets its column, not the next line's 1
                yield line_number, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield line_number, Unparsable(f"invalid JSON: {exc.msg} (column {exc.colno})")


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several top-level values: JSON Lines under a .json name
            yield from _jsonl_rows(path)
            return
        raise DataError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(rows, list):
        found = f"an object with keys {sorted(rows)}" if isinstance(rows, dict) else type(rows).__name__
        raise DataError(f"{path}: expected a JSON array of rows (or one JSON object per line), found {found}")
    yield from enumerate(rows, start=1)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    number = 0
    for record_batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in record_batch.to_pylist():
            number += 1
            yield number, row
