"""The answer-extraction rule of the math environment, case by case."""

from __future__ import annotations

import pytest

from posttrain_env_math.extract import extract_answer, last_boxed


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        # 1. the last \boxed{...}, braces balanced, wins over everything else
        ("so x = \\boxed{\\frac{1}{2}} and the answer is 7", "\\frac{1}{2}"),
        ("first \\boxed{1}, then corrected: \\boxed{2}", "2"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{ 12 }", "12"),
        ("a closed \\boxed{3} then an open \\boxed{4", "3"),
        # 2. the rest of the line after the last "answer is" / "answer:"
        ("Thinking 1 2 3... The answer is $\\frac{3}{4}$.\nDone 9", "\\frac{3}{4}"),
        ("ANSWER: x^2 + 1", "x^2 + 1"),
        ("the answer is 5. No wait, the final answer is 6.", "6"),
        # 3. the last number
        ("42", "42"),
        ("I think it is 1,000 apples, or -3.5", "-3.5"),
        ("so 5-3 = 2", "2"),
        ("ratio 3/4", "3/4"),
    ],
)
def test_extraction_rule(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize("response", ["", "no idea", "\\boxed{}", "The answer is", "answer: ."])
def test_no_answer(response):
    assert extract_answer(response) is None


def test_unbalanced_box_is_not_an_answer():
    assert last_boxed("\\boxed{\\frac{1}{2}") is None
