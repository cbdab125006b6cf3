"""Counting squares with a tiny vision-language model: SFT, then GRPO from the SFT model, seed
by seed. Does GRPO raise the accuracy SFT reached?

    python benchmarks/vlm_counting.py [--seeds 0 1 2] [--out runs/vlm_counting_bench]
    python benchmarks/vlm_counting.py --table       # the docs table, from the committed results

Each seed writes the counting example's model and data once
(:func:`posttrain.testing.shapes.write_counting_example`: the same model and rows for every
seed), runs ``examples/configs/vlm_counting_sft.yaml`` and then
``examples/configs/vlm_counting_grpo.yaml`` on its export, both with ``seed`` set, through the
command line. The accuracies are GRPO's greedy validation on the 256 held-out prompts: at step 0
(the SFT model) and after the last step. Results go to ``benchmarks/learning/vlm_counting.json``;
``--table`` renders that file as the table of docs/vision.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from report import mean_sd  # noqa: E402

RESULTS = REPO / "benchmarks" / "learning" / "vlm_counting.json"  # rendered into docs/vision.md
CONFIGS = REPO / "examples" / "configs"


def run(algorithm: str, config: str, overrides: list[str]) -> float:
    """``posttrain run`` of one stage; its wall seconds."""
    start = time.perf_counter()
    command = [str(Path(sys.executable).parent / "posttrain"), "run", algorithm, "--config", str(CONFIGS / config),
               "logger.progress_bar=false", *overrides]
    subprocess.run(command, check=True, cwd=REPO)
    return time.perf_counter() - start


def run_seed(out: Path, seed: int) -> dict[str, Any]:
    """One seed's row: the SFT model's accuracy, GRPO's after its last step, and each stage's seconds."""
    from posttrain.run.metrics import read_metrics
    from posttrain.testing.shapes import write_counting_example

    data = write_counting_example(out / "data")
    sft, grpo = out / f"seed_{seed}" / "sft", out / f"seed_{seed}" / "grpo"
    sft_seconds = run("sft", "vlm_counting_sft.yaml", [
        f"seed={seed}", f"run_dir={sft}", f"sft.export_dir={sft / 'hf'}", f"policy.model={data / 'model'}",
        f"data.train={data / 'sft/train/train.jsonl'}", f"data.validation={data / 'sft/val/val.jsonl'}",
    ])
    grpo_seconds = run("grpo", "vlm_counting_grpo.yaml", [
        f"seed={seed}", f"run_dir={grpo}", f"policy.model={sft / 'hf'}",
        f"data.train={data / 'grpo/prompts/prompts.jsonl'}", f"data.validation={data / 'grpo/val/val.jsonl'}",
    ])
    validation = read_metrics(grpo / "metrics.jsonl", "validation")
    return {"seed": seed, "after SFT": validation[0]["accuracy"], "after GRPO": validation[-1]["accuracy"],
            "grpo steps": validation[-1]["step"], "sft seconds": round(sft_seconds, 1),
            "grpo seconds": round(grpo_seconds, 1)}


def table(results: dict[str, Any]) -> str:
    """The markdown table of ``results`` (the committed file's content)."""
    rows = results["rows"]
    lines = ["| seed | after SFT | after GRPO | gain | SFT s | GRPO s |", "|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        gain = row["after GRPO"] - row["after SFT"]
        lines.append(f"| {row['seed']} | {row['after SFT']:.3f} | {row['after GRPO']:.3f} | {gain:+.3f} | "
                     f"{row['sft seconds']:.0f} | {row['grpo seconds']:.0f} |")

    gains = [r["after GRPO"] - r["after SFT"] for r in rows]
    lines.append(f"| mean ± sd | {mean_sd([r['after SFT'] for r in rows])} | "
                 f"{mean_sd([r['after GRPO'] for r in rows])} | {mean_sd(gains, '+')} | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/vlm_counting_bench")
    parser.add_argument("--table", action="store_true", help=f"print the table of {RESULTS.name} and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(RESULTS.read_text())), end="")
        return
    out = Path(args.out).resolve()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(out, seed))
        results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                   "rows": rows}
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")  # kept as the seeds finish
    print("\n" + table(results))


if __name__ == "__main__":
    main()
