"""GRPO, Dr. GRPO, CISPO and GSPO (product weight) on the quickstart task, seed by seed, from
the same SFT model.

    python benchmarks/loss_variants.py [--seeds 0 1 2] [--out runs/loss_variants]
    python benchmarks/loss_variants.py --table       # the docs table, from the committed results

Each seed runs the quickstart (SFT, then its GRPO stage: the default loss), then one more RL
stage per variant from that seed's SFT model with the quickstart's config and the variant's
``grpo.loss`` options (:data:`VARIANTS`), through :mod:`quickstart_rl`'s stages (a stage
already in ``--out`` is not run again). The greedy validation accuracy on the 256 held-out
problems after each stage, and its wall seconds, go to ``benchmarks/learning/loss_variants.json``
(and ``--out``); ``--table`` renders that file as the table of docs/algorithms/loss-reference.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quickstart_rl  # noqa: E402
from report import mean_sd  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "learning" / "loss_variants.json"  # rendered into loss-reference.md, not docs/benchmarks.md

#: Each variant (its folder name under --out): its name in the table and its overrides of the
#: quickstart's GRPO stage, whose default loss is the table's "GRPO".
VARIANTS: dict[str, tuple[str, list[str]]] = {
    # the group mean without the std, and the constant normaliser (generation.max_new_tokens)
    "dr-grpo": ("Dr. GRPO", ["grpo.baseline=mean", "grpo.normalize_rewards=false",
                             "grpo.loss.token_normalizer=constant"]),
    "cispo": ("CISPO", ["grpo.loss.policy_loss=cispo", "grpo.loss.ratio_clip_low=1.0", "grpo.loss.ratio_clip_high=4.0"]),
    "gspo-product": ("GSPO (product weight)", [
        "grpo.loss.sequence_level_ratio=true", "grpo.loss.token_level_loss=false",
        "grpo.loss.sequence_is_weight=product", "grpo.loss.importance_sampling_correction=tis", "grpo.loss.is_max=2.0",
        "grpo.loss.ratio_clip_low=0.003", "grpo.loss.ratio_clip_high=0.004",
    ]),
}
BASELINE = "GRPO"


def run_seed(out: Path, seed: int) -> dict[str, Any]:
    """One seed's row: the accuracy after SFT, and each variant's accuracy and RL seconds."""
    row = quickstart_rl.run_seed(out, seed, {key: ("grpo", overrides) for key, (_, overrides) in VARIANTS.items()})
    return {
        "seed": row["seed"],
        "after SFT": row["after SFT"],
        BASELINE: {"accuracy": row["sync"]["accuracy"], "seconds": row["sync"]["seconds"]},
        **{name: {"accuracy": row[key]["accuracy"], "seconds": row[key]["seconds"]} for key, (name, _) in VARIANTS.items()},
    }


def table(results: dict[str, Any]) -> str:
    """The markdown table of ``results`` (the committed file's content)."""
    rows = results["rows"]
    names = [BASELINE, *(name for name, _ in VARIANTS.values())]
    lines = ["| seed | after SFT | " + " | ".join(f"after {name}" for name in names) + " |",
             "|---:|---:|" + "---:|" * len(names)]
    for row in rows:
        lines.append(f"| {row['seed']} | {row['after SFT']:.3f} | "
                     + " | ".join(f"{row[name]['accuracy']:.3f}" for name in names) + " |")

    lines.append(f"| mean ± sd | {mean_sd([r['after SFT'] for r in rows])} | "
                 + " | ".join(mean_sd([r[name]["accuracy"] for r in rows]) for name in names) + " |")
    gains = " | ".join(mean_sd([r[name]["accuracy"] - r["after SFT"] for r in rows], "+") for name in names)
    lines.append(f"| gain over SFT | | {gains} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/loss_variants")
    parser.add_argument("--table", action="store_true", help=f"print the table of {RESULTS.name} and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(RESULTS.read_text())), end="")
        return
    out = Path(args.out).resolve()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(out, seed))
        results = {"overrides": {BASELINE: [], **dict(VARIANTS.values())},
                   "machine": f"{platform.machine()}, {platform.python_version()}", "rows": rows}
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")  # kept as the seeds finish
    print("\n" + table(results))


if __name__ == "__main__":
    main()
