"""The quickstart's task: small addition problems with verifiable answers, as JSONL.

Every file is generated from a seed, so two machines get identical data. Rows follow the
formats posttrain's data loading reads: SFT rows are ``messages`` conversations; RL and
validation rows are prompts with an ``answer`` for the ``math`` environment and a ``task``
naming it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs


@attrs.frozen
class TaskFiles:
    sft_train: Path
    sft_validation: Path  # the validation problems as conversations, for SFT's validation loss
    rl_train: Path
    validation: Path


def problem(rng: random.Random, max_operand: int) -> tuple[str, str]:
    """One question and its answer, e.g. ``("17+25=", "42")``."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return f"{a}+{b}=", str(a + b)


def write_task(folder: str | Path, *, num_sft: int, num_rl: int, num_validation: int, max_operand: int = 30, seed: int = 0) -> TaskFiles:
    """Write three disjoint JSONL files of addition problems into ``folder``.

    Validation problems never appear in either training file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    space = (max_operand + 1) ** 2
    wanted = num_sft + num_rl + num_validation
    if wanted > space:
        raise ValueError(f"asked for {wanted} distinct problems, but operands up to {max_operand} give only {space}")
    seen: dict[str, str] = {}
    while len(seen) < wanted:
        question, answer = problem(rng, max_operand)
        seen.setdefault(question, answer)
    items = list(seen.items())
    validation, sft, rl = items[:num_validation], items[num_validation:num_validation + num_sft], items[num_validation + num_sft:]
    files = TaskFiles(folder / "sft_train.jsonl", folder / "sft_validation.jsonl", folder / "rl_train.jsonl", folder / "validation.jsonl")
    for path, rows in ((files.sft_train, sft), (files.sft_validation, validation)):
        _write(path, [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in rows])
    for path, rows in ((files.rl_train, rl), (files.validation, validation)):
        _write(path, [{"messages": [{"role": "user", "content": q}], "answer": a, "task": "math"} for q, a in rows])
    return files


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
