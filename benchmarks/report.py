"""Write the tables of docs/benchmarks.md from the results files (benchmarks/results/*.json).

    python benchmarks/report.py          # rewrite the tables in the page
    python benchmarks/report.py --check  # change nothing; exit 1 naming the tables that differ

In the page a table is everything between ``<!-- results NAME -->`` and ``<!-- /results -->``
(``NAME``: the file ``benchmarks/results/NAME.json``, see :mod:`record`); the rest of the
page is left as written. Every results file must have its place in the page.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import COLUMNS, RESULTS, TIME_FIELDS  # noqa: E402

PAGE = RESULTS.parents[1] / "docs" / "benchmarks.md"
_BLOCK = re.compile(r"(<!-- results (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def load_records(folder: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every results file in ``folder``, by name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def _decimals(value: Any) -> int:
    """The decimals a stored number was written with (``1.50`` is stored as ``1.5``: 1)."""
    if isinstance(value, bool) or not isinstance(value, float):
        return 0
    text = repr(value)
    return len(text.partition(".")[2]) if "e" not in text else 3


def _cell(value: Any, fmt: str | None, decimals: int) -> str:
    """A number with its column's format, or else as many decimals as the column's most
    precise number (a column written 0.5 and 0.457 shows 0.500); text as it is."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return format(value, fmt if fmt is not None else f".{decimals}f")


def _with_ratios(record: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(run label, row) for every row, each row with ``vs_baseline``: its time over the time
    of its run's baseline row."""
    out = []
    baseline = record.get("baseline")
    for run in record["runs"]:
        base = next((row for row in run["rows"] if row.get("side") == baseline), None)
        for row in run["rows"]:
            row = dict(row)
            field = next((f for f in TIME_FIELDS if isinstance(row.get(f), (int, float))), None)
            if base is not None and field is not None and isinstance(base.get(field), (int, float)):
                row["vs_baseline"] = row[field] / base[field]
            out.append((run["label"], row))
    return out


def table(record: Mapping[str, Any]) -> str:
    """The Markdown table of a results file: a column per field some row has (or per field of
    ``columns``), a first column naming the run when there are several."""
    rows = _with_ratios(record)
    present = {field for _, row in rows for field, value in row.items() if value is not None}
    unknown = present - set(COLUMNS)
    if unknown:
        raise ValueError(f"{record['title']}: fields {sorted(unknown)} are not columns of record.COLUMNS")
    wanted = record.get("columns")
    fields = [f for f in COLUMNS if f in present and (wanted is None or f in wanted or f == "vs_baseline")]
    several = len(record["runs"]) > 1
    headings = [COLUMNS[f].heading for f in fields]
    aligns = ["---" if COLUMNS[f].text else "---:" for f in fields]
    if several:
        headings.insert(0, record.get("run_header", "run"))
        aligns.insert(0, "---")
    lines = ["| " + " | ".join(headings) + " |", "|" + "|".join(aligns) + "|"]
    decimals = {f: max(_decimals(row.get(f)) for _, row in rows) for f in fields}
    previous = None
    for label, row in rows:
        cells = [_cell(row.get(f), COLUMNS[f].fmt, decimals[f]) for f in fields]
        if several:
            cells.insert(0, label if label != previous else "")
            previous = label
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_sd(values: Sequence[float], sign: str = "") -> str:
    """``mean ± sd`` of per-seed results to 3 decimals (the mean alone for one value); ``sign``
    ``"+"`` writes the mean's sign, for gains. The learning tables' last rows."""
    mean = f"{statistics.mean(values):{sign}.3f}"
    return f"{mean} ± {statistics.stdev(values):.3f}" if len(values) > 1 else mean


def _commands(runs: Sequence[Mapping[str, Any]]) -> str:
    """``Command: `...` (details).``: each distinct command once, in the table's order of
    runs, with the details of the runs it made (labelled when it made several)."""
    by_command: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        by_command.setdefault(run["command"], []).append(run)
    entries = []
    for command, made in by_command.items():
        details = [": ".join(filter(None, [run["label"] if len(made) > 1 else "", run.get("details")])) for run in made]
        entries.append(f"`{command}`" + (f" ({'; '.join(filter(None, details))})" if any(details) else ""))
    return ("Commands: " if len(entries) > 1 else "Command: ") + "; ".join(entries) + "."


def render(record: Mapping[str, Any]) -> str:
    """A results file as the page shows it: what was measured and where, the table, the
    command of each run (with its load and machine rates), the notes."""
    how = _commands(record["runs"])
    conditions = record["conditions"][:1].upper() + record["conditions"][1:]
    baseline = f" Baseline: `{record['baseline']}`." if record.get("baseline") else ""
    parts = [f"**{record['title']}.** {conditions}. Machine: {record['machine']}.{baseline}", "", table(record), "", how]
    if record.get("notes"):
        parts += ["", *(f"- {note}" for note in record["notes"])]
    return "\n".join(parts) + "\n"


def update(page: str, records: Mapping[str, Mapping[str, Any]]) -> str:
    """``page`` with every results block rewritten from ``records``; a block naming no
    results file, or a results file without a block, is an error."""
    named = [m["name"] for m in _BLOCK.finditer(page)]
    missing = sorted(set(named) - set(records))
    if missing:
        raise ValueError(f"the page has tables of no results file: {missing} (benchmarks/results/NAME.json)")
    unplaced = sorted(set(records) - set(named))
    if unplaced:
        raise ValueError(f"results files with no place in the page: {unplaced} (add <!-- results NAME --><!-- /results -->)")
    return _BLOCK.sub(lambda m: m[1] + render(records[m["name"]]) + m[4], page)


def differing(page: str, records: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The names of the blocks whose text is not what their results file renders."""
    return [m["name"] for m in _BLOCK.finditer(page) if m["body"] != render(records[m["name"]])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its file")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    page, records = args.page.read_text(), load_records(args.results)
    try:
        updated = update(page, records)
    except ValueError as error:
        print(f"{args.page}: {error}", file=sys.stderr)
        return 2
    if args.check:
        stale = differing(page, records)
        if stale:
            print(f"{args.page}: tables differ from their results files: {', '.join(stale)}; "
                  "run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    if updated != page:
        args.page.write_text(updated)
    print(f"{args.page}: {len(records)} tables from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
