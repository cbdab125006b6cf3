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
