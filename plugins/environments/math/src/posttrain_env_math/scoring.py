"""Score one response against a ground-truth answer with math-verify.

Runs inside :class:`~posttrain.deadline_pool.DeadlinePool` worker processes, so
math-verify's signal-based time limits are switched off (``parsing_timeout=None``,
``timeout_seconds=None``) and the pool enforces the deadline instead.
"""

from __future__ import annotations

import functools
import logging

from math_verify import LatexExtractionConfig, parse, verify

from posttrain_env_math.extract import extract_answer

# math-verify warns once per process that its time limits are off; they are, on purpose.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_LATEX = [LatexExtractionConfig()]


def score_response(response: str, gold: str) -> tuple[str | None, bool]:
    """``(answer, correct)``: the answer extracted from ``response`` (``None`` when there is
    none or math-verify cannot read it) and whether it equals ``gold`` mathematically."""
    answer = extract_answer(response)
    if answer is None:
        return None, False
    predicted = _parse_boxed(answer)
    if not predicted:
        return None, False
    expected = _parse_gold(gold)
    if not expected:
        raise ValueError(f"math-verify cannot read the ground truth {gold!r}")
    return answer, bool(verify(expected, predicted, timeout_seconds=None))


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    """Ground truth like ``42``, ``\\frac{1}{2}``, ``$x^2+1$`` or ``\\boxed{7}``."""
    text = gold.strip().strip("$").strip()
    return parse(text, extraction_config=_LATEX, parsing_timeout=None) if "\\boxed" in text else _parse_boxed(text)


def _parse_boxed(text: str) -> list:
    # Boxing makes math-verify read exactly this text, in LaTeX or plain notation (1/2, x^2+1).
    return parse(f"\\boxed{{{text}}}", extraction_config=_LATEX, parsing_timeout=None)
