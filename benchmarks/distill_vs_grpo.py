"""On-policy distillation against GRPO on the quickstart's task: how many steps each needs
to reach the accuracy of the quickstart's GRPO model.

    python benchmarks/distill_vs_grpo.py --run-dir runs/distill_bench [--seed 0] [--steps 50]

Runs ``posttrain quickstart --seed N`` in RUN_DIR (or reuses one finished there): its SFT
model, and GRPO from it for 100 steps, validated every 10 steps. Then distils the same SFT
model (the student) from the quickstart's final GRPO model (the teacher) on the same prompts,
with the same batch (16 prompts x 8 completions per step), generation settings and greedy
validation on the same 256 held-out problems, validated every 5 steps; the learning rate and
its schedule are GRPO's unless ``--lr`` / ``--schedule`` say otherwise.
Prints, for each, the validation accuracy over its steps and the first step at which it
reached the teacher's accuracy minus ``--margin``, with the wall time and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from posttrain.config import config_from_dict
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_eval.command import default_generation_backend
from posttrain_quickstart.run import GRPO_GENERATIONS, GRPO_LR, GRPO_PROMPTS, run_quickstart


def distill_config(run_dir: Path, steps: int, seed: int, lr: float, schedule: str, name: str) -> dict[str, Any]:
    """The quickstart's GRPO settings, with the distillation algorithm in GRPO's place."""
    return {
        "algorithm": "distill", "seed": seed, "run_dir": str(run_dir / name),
        "cluster": {"num_cpus": 4},
        "policy": {"backend": "dtensor", "model": str(run_dir / "sft_model"), "max_total_sequence_length": 48,
                   "resources": {"cpus": 1}, "train_global_batch_size": 64, "train_micro_batch_size": 32,
                   "logprob_micro_batch_size": 64, "optimizer": {"name": "adamw", "lr": lr},
                   "scheduler": {"name": schedule}},
        "generation": {"backend": default_generation_backend(), "max_new_tokens": 6, "temperature": 1.0,
                       "resources": {"cpus": 1}},
        "data": {"train": str(run_dir / "data" / "rl_train.jsonl"), "validation": str(run_dir / "data" / "validation.jsonl"),
                 "shuffle": True},
        "environments": {"math": {"num_workers": 1}},
        "distill": {"teacher": {"model": str(run_dir / "final_model"), "logprob_micro_batch_size": 64,
                                "resources": {"cpus": 1}},
                    "topk": 16, "num_prompts_per_step": GRPO_PROMPTS, "num_generations_per_prompt": GRPO_GENERATIONS,
                    "max_num_steps": steps, "max_num_epochs": 100, "val_period": 5, "val_at_start": True},
        "checkpointing": {"save_period": 1000, "keep_top_k": 1},
        "logger": {"progress_bar": False},
    }


def curve(metrics: Path) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["accuracy"])) for r in read_metrics(metrics, "validation")]


def first_reaching(points: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, accuracy in points if accuracy >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/distill_bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=50, help="distillation steps (default 50)")
    parser.add_argument("--margin", type=float, default=0.02, help="accuracy below the teacher's that counts (0.02)")
    parser.add_argument("--lr", type=float, default=GRPO_LR, help=f"the student's learning rate (default GRPO's, {GRPO_LR})")
    parser.add_argument("--schedule", default="linear", help="its schedule (default GRPO's, linear to 0 at the last step)")
    args = parser.parse_args()
    run_dir = Path(args.run_dir).resolve()
    loads = [os.getloadavg()[0]]
    began = time.monotonic()
    if not (run_dir / "final_model" / "config.json").is_file():
        run_quickstart(run_dir, [], seed=args.seed)
    quickstart_s = time.monotonic() - began
    loads.append(os.getloadavg()[0])
    began = time.monotonic()
    name = f"distill_lr{args.lr:g}_{args.schedule}_{args.steps}"
    run_algorithm(config_from_dict(distill_config(run_dir, args.steps, args.seed, args.lr, args.schedule, name)))
    distill_s = time.monotonic() - began
    loads.append(os.getloadavg()[0])

    grpo, distilled = curve(run_dir / "grpo" / "metrics.jsonl"), curve(run_dir / name / "metrics.jsonl")
    teacher = grpo[-1][1]
    target = teacher - args.margin
    print(f"\nteacher (the quickstart's GRPO model, seed {args.seed}): accuracy {teacher:.3f}; target {target:.3f}")
    print(f"load average (1 min) at start / after the quickstart / after distillation: "
          f"{' / '.join(f'{load:.1f}' for load in loads)}; cores: {os.cpu_count()}")
    print("| method | accuracy by step | first step >= target | wall time |")
    print("|---|---|---|---|")
    label = f"distillation (lr {args.lr:g}, {args.schedule})"
    for method, points, seconds in (("GRPO", grpo, None), (label, distilled, distill_s)):
        steps = ", ".join(f"{step}: {accuracy:.3f}" for step, accuracy in points)
        reached = first_reaching(points, target)
        wall = f"{seconds:.0f} s" if seconds is not None else f"{quickstart_s:.0f} s (whole quickstart)"
        print(f"| {method} | {steps} | {reached if reached is not None else 'not reached'} | {wall} |")


if __name__ == "__main__":
    main()
