"""Find the program in a model's reply."""

from __future__ import annotations

import re

# A fenced block: ``` + optional language tag + rest of the line, then the body up to the
# closing fence or, for a reply cut off mid-block, the end of the text.
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "py", "python3"})


def extract_code(text: str) -> str:
    """The last ```python (or ```py / ```python3) block of ``text``; else its last fenced
    block without a language tag; else the whole text. A block left open at the end of the
    text (generation stopped) runs to the end."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(text)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: not tag):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return text
