"""docs/benchmarks.md is a report generated from the benchmarks' results files
(benchmarks/results/*.json): its tables are what ``benchmarks/report.py`` writes from them,
every file says what was measured, when, on what and with which command (a command the
script still accepts), and the page stays a report, under 300 lines."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.docs.commands import check_command
from tests.docs.pages import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import record  # noqa: E402
import report  # noqa: E402

RECORDS = report.load_records()
PAGE = REPO / "docs" / "benchmarks.md"
FILE_KEYS = {"title", "conditions", "machine", "runs"}
OPTIONAL_FILE_KEYS = {"baseline", "run_header", "columns", "notes"}
RUN_KEYS = {"label", "command", "date", "source", "rows"}
OPTIONAL_RUN_KEYS = {"details", "code"}
DATE = re.compile(r"\d{4}-\d\d-\d\d( \d\d:\d\d( UTC)?)?")


def test_the_pages_tables_are_written_from_the_results_files():
    page = PAGE.read_text()
    assert page == report.update(page, RECORDS), (
        f"tables of docs/benchmarks.md differ from benchmarks/results: {report.differing(page, RECORDS)}; "
        "run python benchmarks/report.py"
    )


def test_the_page_is_a_report_under_300_lines():
    lines = PAGE.read_text().count("\n")
    assert lines < 300, f"docs/benchmarks.md has {lines} lines: a report of the latest results, not their history"


class RepositorySession:
    """What :func:`check_command` needs to parse a command run from the repository root."""

    root = REPO
    paths: list[Path] = []

    def install(self, folder: Path) -> None:
        raise AssertionError("a results file's command installs nothing")

    def load(self, path, overrides=()):
        raise AssertionError("a results file's command loads no config")


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_a_results_file_says_what_when_where_and_how(name):
    file = RECORDS[name]
    assert FILE_KEYS <= set(file) <= FILE_KEYS | OPTIONAL_FILE_KEYS, f"{name}.json: keys {sorted(file)}"
    assert file["runs"] and len({run["label"] for run in file["runs"]}) == len(file["runs"]), f"{name}.json: run labels"
    for run in file["runs"]:
        where = f"{name}.json, run {run['label']!r}"
        assert RUN_KEYS <= set(run) <= RUN_KEYS | OPTIONAL_RUN_KEYS, f"{where}: keys {sorted(run)}"
        assert DATE.fullmatch(run["date"]), f"{where}: date {run['date']!r} is not YYYY-MM-DD [HH:MM UTC]"
        assert run["rows"], f"{where}: no rows"
        unknown = {field for row in run["rows"] for field in row} - set(record.COLUMNS)
        assert not unknown, f"{where}: fields {sorted(unknown)} are not columns of record.COLUMNS"
        if "baseline" in file:
            assert file["baseline"] in {row.get("side") for row in run["rows"]}, f"{where}: no row of {file['baseline']}"
        check_command(shlex.split(run["command"]), RepositorySession())
