"""Scores of sampled completions: the unbiased pass@k estimator and majority voting (maj@k).
Pure Python on per-prompt lists, so the formulas can be read and checked.

A completion is *correct* when its reward is at least a threshold (``eval.correct_reward``).

- pass@k of a prompt with n completions of which c are correct is the probability that k
  completions drawn without replacement from the n include a correct one:
  ``1 - C(n - c, k) / C(n, k)`` (the unbiased estimator of Chen et al., 2021), computed as the
  product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which never forms a large binomial.
- maj@k of a prompt: its n completions are cut into ``n // k`` consecutive blocks of k (the
  rest is left out); in each block the answers vote (a completion without an answer does not
  vote) and the block scores 1 when the winning answer is correct, 0 otherwise (also when no
  completion of the block has an answer). A tie goes to the tied answer given first in the
  block. The winning answer is correct when the first completion that gave it is. maj@k is
  the mean over the blocks.

Each metric is the mean over prompts.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)`` for ``n = num_samples``, ``c = num_correct``; refuses ``k > n``."""
    n, c = num_samples, num_correct
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: {c} correct out of {n} completions is impossible")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least {k} completions per prompt, got {n}")
    if n - c < k:  # every draw of k includes a correct completion
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most frequent answer among ``answers`` is correct (see the module
    docstring for ties and completions without an answer)."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not counts:
        return False
    winner = max(counts, key=lambda answer: (counts[answer], -first[answer]))
    return bool(correct[first[winner]])


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one prompt's completions (module docstring); refuses ``k > len(answers)``."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@{k} needs at least {k} completions per prompt, got {n}")
    blocks = [range(start, start + k) for start in range(0, n - k + 1, k)]
    return sum(majority_vote([answers[i] for i in b], [correct[i] for i in b]) for b in blocks) / len(blocks)


def score_prompts(
    rewards: Sequence[Sequence[float]],
    answers: Sequence[Sequence[str | None]],
    ks: Sequence[int],
    correct_reward: float,
) -> dict[str, float]:
    """For each k of ``ks``, ``pass_at_<k>`` and ``maj_at_<k>``, each the mean over prompts;
    ``rewards[p]`` and ``answers[p]`` hold prompt p's completions, the same number for every
    prompt."""
    if not rewards:
        raise ValueError("no prompts to score")
    n = len(rewards[0])
    if any(len(r) != n for r in rewards) or len(answers) != len(rewards):
        raise ValueError("every prompt needs the same number of completions, with an answer (or None) each")
    correct = [[r >= correct_reward for r in row] for row in rewards]
    scores: dict[str, float] = {}
    for k in ks:
        scores[f"pass_at_{k}"] = _mean([pass_at_k(n, sum(row), k) for row in correct])
        scores[f"maj_at_{k}"] = _mean([maj_at_k(a, c, k) for a, c in zip(answers, correct, strict=True)])
    return scores


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
