"""SFT, posttrain vs TRL's SFTTrainer: 16 conversations of skewed lengths per step.

    python benchmarks/sft.py --model small --reps 2

Sides: ``posttrain-packed`` (sequence packing, the comparison baseline), ``posttrain-padded``
(one padded microbatch per step), ``trl-default`` (SFTTrainer's defaults: padded batches,
gradient checkpointing on) and ``trl-best`` (``padding_free=True``, gradient checkpointing
off). All: float32, AdamW at a constant ``--lr``, gradient clipping 1.0, NLL averaged over
the assistant tokens of the step, samples in file order. Floor: a training pass over the
real tokens, 3 x :func:`common.forward_flops`. See docs/benchmarks.md.
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


def write_conversations(spec: dict[str, Any], path: Path) -> None:
    """``rows_per_step x (warmup + steps)`` one-turn conversations whose token lengths follow
    :func:`common.skewed_lengths`; a third of each is the user's turn."""
    count = spec["rows_per_step"] * (spec["warmup"] + spec["steps"])
    g = torch.Generator().manual_seed(spec["seed"])
    template = template_tokens(spec["model_dir"])
    with path.open("w") as f:
        for total in skewed_lengths(count, spec["max_len"], spec["seed"]):
            user = max(1, (total - template) // 3)
            answer = max(1, total - template - user)
            f.write(json.dumps({"messages": [{"role": "user", "content": random_text(user, g)},
                                             {"role": "assistant", "content": random_text(answer, g)}]}) + "\n")


WORKLOAD = Workload(
    name="sft",
    script=Path(__file__).resolve(),
    sides={
        "posttrain-packed": lambda spec: posttrain_side(spec, "sft", {"loss": "nll"}, packing=True),
        "trl-default": lambda spec: trl_side(spec, "sft", best=False),
        "posttrain-padded": lambda spec: posttrain_side(spec, "sft", {"loss": "nll"}, packing=False),
        "trl-best": lambda spec: trl_side(spec, "sft", best=True),
    },
    baseline="posttrain-packed",
    write_data=write_conversations,
    step_flops=lambda config, lengths: 3 * forward_flops(config, lengths),
    rows_per_step=16,
    flops_rule="training: 3 x forward over the real tokens",
)

if __name__ == "__main__":
    main(WORKLOAD)
