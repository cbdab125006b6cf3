"""The quickstart task trained by synchronous and asynchronous GRPO, seed by seed.

    python benchmarks/quickstart_async.py [--seeds 0 1 2] [--staleness 2] [--out runs/quickstart_async]

For each seed: ``posttrain quickstart --seed N`` (SFT, then synchronous GRPO with the engine
colocated, the quickstart's defaults), then two more GRPO stages from the same SFT model,
with the same config except the engine on its own worker (``generation.colocated: false``)
and ``grpo.asynchronous.max_staleness_steps: K``: one with the default importance-sampling
correction (TIS to [0, 2]), one with it off. Prints the greedy validation accuracy (256
held-out problems) after SFT and after each GRPO, the GRPO stage's wall seconds, and the mean
and max staleness of the asynchronous runs; writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, list[str]] = {
    "async": ["generation.colocated=false"],
    "async, no IS": ["generation.colocated=false", "grpo.asynchronous.importance_sampling_correction=false"],
}


def grpo_stage(run_dir: Path, seed: int, name: str, overrides: list[str]) -> dict[str, Any]:
    """The quickstart's GRPO stage from its SFT model, with ``overrides``, in ``run_dir/name``."""
    from posttrain.config import config_from_dict
    from posttrain.run.context import run_algorithm
    from posttrain.run.metrics import read_metrics
    from posttrain_quickstart.run import GRPO_STEPS, _grpo_config
    from posttrain_quickstart.task import TaskFiles

    data = run_dir / "quickstart" / "data"
    files = TaskFiles(data / "sft_train.jsonl", data / "sft_validation.jsonl", data / "rl_train.jsonl",
                      data / "validation.jsonl")
    stage_dir = run_dir / name.replace(",", "").replace(" ", "_")
    config = config_from_dict(
        _grpo_config(run_dir / "quickstart" / "sft_model", stage_dir, files, GRPO_STEPS, None, seed),
        [*overrides, "algorithm=grpo"],
    )
    began = time.monotonic()
    result = run_algorithm(config)
    train = read_metrics(stage_dir / "metrics.jsonl", "train")
    return {
        "accuracy": result["validation/accuracy"],
        "seconds": time.monotonic() - began,
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in train),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in train),
    }


def run_seed(out: Path, seed: int, staleness: int) -> dict[str, Any]:
    from posttrain.run.metrics import read_metrics
    from posttrain_quickstart.run import run_quickstart

    run_dir = out / f"seed_{seed}"
    began = time.monotonic()
    accuracies = run_quickstart(run_dir / "quickstart", [], seed=seed)
    sync_seconds = time.monotonic() - began  # the whole quickstart; the GRPO stage's own below
    grpo_records = read_metrics(run_dir / "quickstart" / "grpo" / "metrics.jsonl", "train")
    row: dict[str, Any] = {
        "seed": seed,
        "after SFT": accuracies["after SFT"],
        "sync": {"accuracy": accuracies["after GRPO"], "seconds": grpo_records[-1]["time"] - grpo_records[0]["time"],
                 "quickstart_seconds": sync_seconds},
    }
    for name, overrides in VARIANTS.items():
        row[name] = grpo_stage(run_dir, seed, name, [*overrides, f"grpo.asynchronous.max_staleness_steps={staleness}"])
    return row


def table(rows: list[dict[str, Any]], staleness: int) -> str:
    names = ["sync", *VARIANTS]
    lines = [f"| seed | after SFT | {' | '.join(f'after GRPO, {n}' for n in names)} | "
             f"{' | '.join(f'GRPO s, {n}' for n in names)} | staleness mean / max (async) |",
             "|---:|---:|" + "---:|" * (2 * len(names)) + "---:|"]
    for row in rows:
        lines.append(f"| {row['seed']} | {row['after SFT']:.3f} | "
                     + " | ".join(f"{row[n]['accuracy']:.3f}" for n in names) + " | "
                     + " | ".join(f"{row[n]['seconds']:.0f}" for n in names)
                     + f" | {row['async']['staleness_mean']:.2f} / {row['async']['staleness_max']:.0f} |")
    means = " | ".join(f"{statistics.mean(r[n]['accuracy'] for r in rows):.3f}" for n in names)
    lines.append(f"| mean | {statistics.mean(r['after SFT'] for r in rows):.3f} | {means} | | | | |")
    return (f"GRPO on the quickstart task: synchronous (colocated engine) and asynchronous "
            f"(max_staleness_steps={staleness}, engine on its own worker), greedy accuracy on 256 held-out problems.\n\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--out", default="runs/quickstart_async")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    rows = [run_seed(out, seed, args.staleness) for seed in args.seeds]
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    text = table(rows, args.staleness)
    (out / "results.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    sys.exit(main())
