"""The quickstart's SFT stage with AdamW and with Muon, side by side: the validation loss
along the way, and the greedy accuracy of each SFT model on the 256 held-out problems.

    python benchmarks/optimizers.py [--seed 0] [--epochs 35] [--out runs/optimizers]

Both runs start from the same seeded quickstart model and data, with the quickstart's SFT
settings (batch 16, sequence packing, constant learning rate 1e-3, 35 epochs); ``muon``
changes only ``policy.optimizer.name`` (its default ``adjust_lr_fn: match_rms_adamw`` carries
AdamW's learning rate over). The validation loss is measured every 5 epochs. Prints a
Markdown table (docs/backends/dtensor.md) and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

OPTIMIZERS = ("adamw", "muon")
STEPS_PER_EPOCH = 25  # 400 rows in batches of 16


def run(out: Path, name: str, seed: int, epochs: int) -> dict[str, Any]:
    """SFT with optimizer ``name``, then a greedy evaluation of the exported model."""
    from posttrain.config import config_from_dict
    from posttrain.models.tiny import build_tiny_model
    from posttrain.run.context import run_algorithm
    from posttrain.run.metrics import read_metrics
    from posttrain_quickstart.run import NUM_RL, NUM_SFT, NUM_VALIDATION, _eval_config, _sft_config
    from posttrain_quickstart.task import write_task

    files = write_task(out / "data", num_sft=NUM_SFT, num_rl=NUM_RL, num_validation=NUM_VALIDATION, seed=0)
    model = build_tiny_model(out / "base_model", size="quickstart", seed=seed)
    folder = out / name
    config = _sft_config(model, folder / "sft", files, epochs, folder / "sft_model", seed)
    config["policy"]["optimizer"]["name"] = name
    config["sft"]["val_period"] = 5 * STEPS_PER_EPOCH
    start = time.monotonic()
    run_algorithm(config_from_dict(config, ["algorithm=sft"]))
    seconds = time.monotonic() - start
    losses = {r["step"]: r["loss"] for r in read_metrics(folder / "sft" / "metrics.jsonl", "validation")}
    evaluated = run_algorithm(config_from_dict(_eval_config(folder / "sft_model", folder / "eval", files, seed),
                                               ["algorithm=eval"]))
    return {"losses": losses, "accuracy": evaluated["mean_reward"], "seconds": seconds}


def table(results: dict[str, dict[str, Any]]) -> str:
    steps = sorted({int(s) for r in results.values() for s in r["losses"]})
    lines = ["| step | " + " | ".join(f"validation loss, {n}" for n in results) + " |",
             "|---:|" + "---:|" * len(results)]
    lines += [f"| {s} | " + " | ".join(f"{r['losses'].get(str(s), r['losses'].get(s, float('nan'))):.4f}"
                                      for r in results.values()) + " |" for s in steps]
    lines.append("| greedy accuracy | " + " | ".join(f"{r['accuracy']:.3f}" for r in results.values()) + " |")
    lines.append("| SFT seconds | " + " | ".join(f"{r['seconds']:.0f}" for r in results.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=35)
    parser.add_argument("--out", default="runs/optimizers")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    results = {name: run(out, name, args.seed, args.epochs) for name in OPTIMIZERS}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + table(results))


if __name__ == "__main__":
    main()
