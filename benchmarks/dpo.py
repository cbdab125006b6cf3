"""DPO, posttrain vs TRL's DPOTrainer: 8 preference pairs (16 rows) of skewed lengths per step.

    python benchmarks/dpo.py --model small --reps 2

Sides as in ``sft.py``: ``posttrain-packed`` (the baseline), ``posttrain-padded``,
``trl-default`` (DPOTrainer's defaults: padded, gradient checkpointing on, reference model
scored every step) and ``trl-best`` (``padding_free=True``, gradient checkpointing off).
All: sigmoid loss, beta 0.1, the frozen initial weights as reference, float32, AdamW at a
constant ``--lr``, clipping 1.0. Floor: a training pass over every row's real tokens plus
the reference forward pass, 4 x :func:`common.forward_flops`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Workload, forward_flops, main, random_text, skewed_lengths, template_tokens  # noqa: E402
from sides import posttrain_side, trl_side  # noqa: E402


def write_pairs(spec: dict[str, Any], path: Path) -> None:
    """``rows_per_step / 2 x (warmup + steps)`` pairs; each row's length (prompt + completion)
    follows :func:`common.skewed_lengths`, the prompt is a third of the shorter row."""
    pairs = spec["rows_per_step"] // 2 * (spec["warmup"] + spec["steps"])
    lengths = skewed_lengths(2 * pairs, spec["max_len"], spec["seed"])
    g = torch.Generator().manual_seed(spec["seed"])
    template = template_tokens(spec["model_dir"])
    with path.open("w") as f:
        for a, b in zip(lengths[0::2], lengths[1::2], strict=True):
            prompt = max(1, (min(a, b) - template) // 3)
            user = [{"role": "user", "content": random_text(prompt, g)}]
            chosen, rejected = (
                [{"role": "assistant", "content": random_text(max(1, total - template - prompt), g)}] for total in (a, b)
            )
            row = {"prompt": user, "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(row) + "\n")


SECTION = {"beta": 0.1, "loss_type": "sigmoid"}

WORKLOAD = Workload(
    name="dpo",
    script=Path(__file__).resolve(),
    sides={
        "posttrain-packed": lambda spec: posttrain_side(spec, "dpo", SECTION, packing=True),
        "trl-default": lambda spec: trl_side(spec, "dpo", best=False),
        "posttrain-padded": lambda spec: posttrain_side(spec, "dpo", SECTION, packing=False),
        "trl-best": lambda spec: trl_side(spec, "dpo", best=True),
    },
    baseline="posttrain-packed",
    write_data=write_pairs,
    step_flops=lambda config, lengths: 4 * forward_flops(config, lengths),
    rows_per_step=16,
    flops_rule="training 3 x forward + reference 1 x forward, real tokens",
)

if __name__ == "__main__":
    main(WORKLOAD)
