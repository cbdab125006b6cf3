"""The documentation, the README, the benchmarks and the tests speak to a reader of the
product: no numbers of this project's tracker (which a reader cannot follow) and no
work-diary wording (dated entries, "this session", "today"). Citations of other projects'
trackers ("NeMo RL #1256") stay. Markdown files are read whole; Python files, their
comments and docstrings (a string a test sends, e.g. a chat session's error message, is data)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from tests.docs.pages import REPO

#: "#123": a tracker's number, this project's unless it follows the name of a project whose
#: tracker the pages may cite (:data:`CITATION`).
NUMBER = re.compile(r"(?<![\w&/])#\d+\b")
CITATION = re.compile(r"\b(?:NeMo RL|NeMo-RL|verl|TRL|vLLM|transformers|PyTorch|torch|Ray|Megatron-LM|megatron-core|peft"
                      r"|OpenRLHF|pluggy) $")
TRACKER = [
    re.compile(r"\bissues? #?\d+", re.IGNORECASE),  # "issue 24", "issue #24"
    re.compile(r"\bthe issue(?:'s)?\b", re.IGNORECASE),  # "the targets": the tracker's issue
    NUMBER,
]
DIARY = [
    re.compile(r"\b(?:this|that|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) session\b", re.IGNORECASE),
    re.compile(r"\b(?:today|yesterday|tonight)\b", re.IGNORECASE),
    re.compile(r"\bthis (?:morning|afternoon|evening|week)\b|\b(?:later|earlier) that day\b|\bthe same (?:day|afternoon|morning)\b",
               re.IGNORECASE),
    re.compile(r"\bnot (?:changed|rerun|done) this\b", re.IGNORECASE),
]
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")  # a dated entry; dates of measurements live in benchmarks/results/


def files() -> list[Path]:
    found = [REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md"),
             *REPO.glob("plugins/*/*/README.md"), *REPO.glob("examples/**/*.md"),
             *(REPO / "benchmarks").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    return sorted(path for path in found if path.is_file() and path != Path(__file__))  # this file quotes them


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a reader reads as prose: every line of a Markdown file;
    the comments and docstrings of a Python file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), start=1))
    out = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(text).readline)
           if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                out += [(first + k, line) for k, line in enumerate(doc.splitlines())]
    return sorted(out)


def offences(path: Path, root: Path = REPO) -> list[str]:
    """Every match in ``path``'s prose, line by line, in pattern order; dates are not looked
    for in the changelog (a release is dated)."""
    patterns = TRACKER + DIARY + ([DATE] if path.name != "CHANGELOG.md" else [])
    where = path.relative_to(root)
    return [f"{where}:{number}: {match[0]!r} in {line.strip()[:100]!r}"
            for number, line in prose(path) for pattern in patterns for match in pattern.finditer(line)
            if not (pattern is NUMBER and CITATION.search(line[:match.start()]))]


def test_docs_readme_benchmarks_and_tests_hold_no_tracker_numbers_or_diary():
    found = [offence for path in files() for offence in offences(path)]
    assert not found, "tracker numbers or work-diary wording:\n" + "\n".join(found)


def matched(path: Path) -> list[str]:
    return [offence.split(": ", 1)[1].split(" in ", 1)[0] for offence in offences(path, path.parent)]


def test_the_patterns_find_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("### Memory (2026-11-27, sixth session)\nAgainst issue 24's targets; see #12.\n"
                    "Not changed this session. Measured today.\nAs in verl #2996 and NeMo RL #1256.\n")
    assert matched(page) == ["'sixth session'", "'2026-11-27'", "'issue 24'", "'#12'", "'this session'", "'today'",
                             "'Not changed this'"]
    script = tmp_path / "test_x.py"
    script.write_text('"""Checked on 2026-11-27."""\nSTOPS = ["2024-01-01"]  # data, issue 3\n'
                      'MESSAGE = "this session\'s turn, today"\n')
    assert matched(script) == ["'2026-11-27'", "'issue 3'"]
