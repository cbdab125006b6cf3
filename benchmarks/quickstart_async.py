"""The quickstart task trained by synchronous and asynchronous GRPO, seed by seed.

    python benchmarks/quickstart_async.py [--seeds 0 1 2] [--staleness 2] [--out runs/quickstart_async]

For each seed: the quickstart (SFT, then synchronous GRPO with the engine colocated, its
defaults), then two more GRPO stages from the same SFT model, with the same config except the
engine on its own worker (``generation.colocated: false``) and
``grpo.asynchronous.max_staleness_steps: K``: one with the default importance-sampling
correction (TIS to [0, 2]), one with it off. Prints the greedy validation accuracy (256
held-out problems) after SFT and after each GRPO, each GRPO stage's wall seconds, and the
mean and max staleness of the asynchronous runs; writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

#: The asynchronous variants: their GRPO overrides besides the staleness bound.
VARIANTS: dict[str, list[str]] = {
    "async": ["generation.colocated=false"],
    "async, no IS": ["generation.colocated=false", "grpo.asynchronous.importance_sampling_correction=false"],
}


def grpo_stage(run_dir: Path) -> dict[str, Any]:
    """The GRPO stage's wall seconds (first to last step) and staleness, from its metrics."""
    from posttrain.run.metrics import read_metrics

    train = read_metrics(run_dir / "grpo" / "metrics.jsonl", "train")
    return {
        "seconds": train[-1]["time"] - train[0]["time"],
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in train),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in train),
    }


def run_seed(out: Path, seed: int, staleness: int) -> dict[str, Any]:
    from posttrain_quickstart.run import run_quickstart

    sync_dir = out / f"seed_{seed}" / "sync"
    accuracies = run_quickstart(sync_dir, [], seed=seed)
    row: dict[str, Any] = {"seed": seed, "after SFT": accuracies["after SFT"],
                           "sync": {"accuracy": accuracies["after GRPO"], **grpo_stage(sync_dir)}}
    for name, overrides in VARIANTS.items():
        stage_dir = out / f"seed_{seed}" / name.replace(",", "").replace(" ", "_")
        began = time.monotonic()
        result = run_quickstart(stage_dir, [], seed=seed, sft_model=sync_dir / "sft_model",
                                grpo_overrides=[*overrides, f"grpo.asynchronous.max_staleness_steps={staleness}"])
        row[name] = {"accuracy": result["after GRPO"], **grpo_stage(stage_dir), "stage_seconds": time.monotonic() - began}
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
    lines.append(f"| mean | {statistics.mean(r['after SFT'] for r in rows):.3f} | {means} |" + " |" * (len(names) + 1))
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
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(out, seed, args.staleness))
        (out / "results.json").write_text(json.dumps(rows, indent=1))  # kept as the seeds finish
    text = table(rows, args.staleness)
    (out / "results.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
