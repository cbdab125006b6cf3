"""What the README and the site's home page say of core's size is true: "a contract of about
N lines", N being what the README's own command counts (``wc -l`` of the contract's files)
within a tenth."""

from __future__ import annotations

import glob
import re
import shlex

from tests.docs.pages import DOCS, REPO

README = REPO / "README.md"
COMMAND = re.compile(r"^cd (core/src/posttrain) && (wc -l .+)$", re.MULTILINE)
CLAIM = re.compile(r"contract you can read in an afternoon, about\s+([\d,]+)\s+lines")


def contract_lines() -> tuple[int, list[str]]:
    """The lines of the files the README's command counts, and those files."""
    match = COMMAND.search(README.read_text())
    assert match, "README.md: no 'cd core/src/posttrain && wc -l FILES' command counting the contract"
    folder = REPO / match[1]
    files = sorted({path for word in shlex.split(match[2])[2:] for path in glob.glob(str(folder / word))})
    assert files, f"README.md: {match[2]} names no file under {match[1]}"
    return sum(len(open(path, encoding="utf-8").read().splitlines()) for path in files), files


def test_the_contract_is_as_long_as_the_pages_say():
    lines, files = contract_lines()
    for page in (README, DOCS / "index.md"):
        claims = [int(n.replace(",", "")) for n in CLAIM.findall(page.read_text())]
        assert claims, f"{page.relative_to(REPO)}: no 'contract you can read in an afternoon, about N lines'"
        for claim in claims:
            assert abs(claim - lines) <= lines / 10, (
                f"{page.relative_to(REPO)} says about {claim} lines; the contract's {len(files)} files have {lines}"
            )


CORE_CLAIM = re.compile(r"All of core is about\s+([\d,]+)\s+lines,\s+([\d,]+)\s+of them code")


def code_and_raw_lines(path) -> tuple[int, int]:
    """Lines of ``path`` holding code (not blank, a comment or a docstring), and all its lines."""
    import ast
    import io
    import tokenize

    source = path.read_text(encoding="utf-8")
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings), len(source.splitlines())


def test_core_is_as_long_as_the_readme_says():
    counts = [code_and_raw_lines(path) for path in (REPO / "core" / "src" / "posttrain").rglob("*.py")]
    code, raw = sum(c for c, _ in counts), sum(r for _, r in counts)
    match = CORE_CLAIM.search(README.read_text())
    assert match, "README.md: no 'All of core is about N lines, M of them code'"
    said_raw, said_code = (int(n.replace(",", "")) for n in match.groups())
    assert abs(said_raw - raw) <= raw / 10 and abs(said_code - code) <= code / 10, (
        f"README.md says core is about {said_raw} lines, {said_code} of them code; it has {raw}, {code} of them code"
    )
