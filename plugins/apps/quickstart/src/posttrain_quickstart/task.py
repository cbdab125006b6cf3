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


def write_task(folder: str | Path, *, num_sft: int, num_rl: int, num_validation: int, max_first: int = 99,
               max_second: int = 9, seed: int = 0) -> TaskFiles:
    """Write three disjoint JSONL files of addition problems ``a+b=`` into ``folder``.

    ``a`` ranges over 0..``max_first`` and ``b`` over 0..``max_second``; the answer is the
    sum in decimal (e.g. ``"47+8="`` -> ``"55"``). Problems are drawn without replacement,
    so validation problems never appear in either training file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(max_first + 1) for b in range(max_second + 1)]
    wanted = num_sft + num_rl + num_validation
    if wanted > len(pairs):
        raise ValueError(f"asked for {wanted} distinct problems, but operands up to {max_first} and {max_second} "
                         f"give only {len(pairs)}")
    items = [(f"{a}+{b}=", str(a + b)) for a, b in random.Random(seed).sample(pairs, wanted)]
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
