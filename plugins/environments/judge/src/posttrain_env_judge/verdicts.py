"""A judge's reply turned into a reward (:class:`~posttrain_env_judge.options.JudgeOptions`
``verdict``); None when the reply holds no verdict (the environment scores it 0 and counts it)."""

from __future__ import annotations

import re
from collections.abc import Mapping

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def number_verdict(reply: str, max_score: float) -> float | None:
    """The first number in ``reply`` divided by ``max_score``, kept in [0, 1]."""
    found = _NUMBER.search(reply)
    if found is None:
        return None
    return min(1.0, max(0.0, float(found.group()) / max_score))


def label_verdict(reply: str, labels: Mapping[str, float]) -> float | None:
    """The value of the label word that comes first in ``reply`` (whole words, any case)."""
    first: tuple[int, float] | None = None
    for label, value in labels.items():
        found = re.search(rf"(?<!\w){re.escape(label)}(?!\w)", reply, flags=re.IGNORECASE)
        if found is not None and (first is None or found.start() < first[0]):
            first = (found.start(), value)
    return None if first is None else first[1]


def probability_verdict(probabilities: Mapping[str, float], labels: Mapping[str, float]) -> float | None:
    """The labels' values weighted by the probability of each label as the reply's first token,
    normalised over the labels; None when the judge gave none of them any probability."""
    total = sum(probabilities.get(label, 0.0) for label in labels)
    if not total > 0:
        return None
    return sum(probabilities.get(label, 0.0) * value for label, value in labels.items()) / total
