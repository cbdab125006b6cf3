"""Find the final answer in a model response.

The rule, first match wins:

1. the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the rest of the line after the last "answer is" or "answer:" (any case), e.g.
   "The final answer is $\\frac{1}{2}$." gives ``\\frac{1}{2}``;
3. the last number in the response: an optionally signed integer (thousands separators
   allowed), decimal or fraction, e.g. "so we get 42" or a bare "42" gives ``42``.

Rules 2 and 3 drop surrounding ``$`` signs and a trailing period. A response with none of
these has no answer (``None``). Non-numeric answers (expressions, sets, text) must use
rule 1 or 2.
"""

from __future__ import annotations

import re

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def extract_answer(response: str) -> str | None:
    """The answer text of ``response`` by the module's rule, or ``None``."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    phrases = list(_ANSWER_PHRASE.finditer(response))
    if phrases:
        answer = _clean(response[phrases[-1].end():].split("\n", 1)[0])
        if answer:
            return answer
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``/``\\fbox{...}`` with balanced braces, or ``None``."""
    for match in reversed(list(_BOX_OPEN.finditer(text))):
        content = _braced(text, match.end() - 1)
        if content is not None:
            return content
    return None


def _braced(text: str, open_at: int) -> str | None:
    """The text inside the brace group opening at ``text[open_at] == "{"``, or ``None`` if unbalanced."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None


def _clean(answer: str) -> str:
    answer = answer.strip().rstrip(".").strip()
    if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$").strip()
    return answer
