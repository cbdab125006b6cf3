"""The quickstart task on a mixture of experts, GRPO with and without routing replay.

    python benchmarks/moe_replay.py [--seeds 0 1 2] [--out runs/moe_replay]

For each seed: a Qwen3-MoE of the quickstart's size (hidden 128, 4 layers, 8 experts of which
2 per token, the character tokenizer) fine-tuned by the quickstart's SFT, then two GRPO stages
from that SFT model with the hf engine sampling in bfloat16 (the trainer in float32, as a GPU
run's engine and master weights): ``measured`` records the rollout's experts and reports the
routers' agreement without replaying them (``policy.moe.router_agreement``), ``replayed``
replays them (``policy.moe.routing_replay: rollout``). Prints the greedy validation accuracy
(256 held-out problems) after SFT and after each GRPO stage, each stage's mean router agreement,
largest ``token_mult_prob_error`` and mean ``mismatch_kl`` and wall seconds; a stage stopped by
the mismatch guard (``grpo.mismatch_guard``) is reported with its step. Writes ``results.json``
and ``results.md``. A stage whose ``result.json`` is in ``--out`` is not run again.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from quickstart_rl import cached

from posttrain_quickstart.run import GRPO_STEPS

#: The engine in bfloat16, the trainer in float32, and the variant's ``policy.moe``.
ENGINE = ["generation.backend=hf", "generation.dtype=bfloat16"]
VARIANTS = {"measured": ["policy.moe.router_agreement=true"], "replayed": ["policy.moe.routing_replay=rollout"]}
#: The quickstart Llama's size, as a Qwen3-MoE.
MOE_SIZE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, initializer_range=0.02)


def stage_result(run_dir: Path) -> dict[str, Any]:
    """A GRPO stage's accuracies and engine-trainer agreement, from its metrics; a stage the
    mismatch guard stopped has no final accuracy (``stopped``: its last step)."""
    from posttrain.run.metrics import read_metrics

    records = read_metrics(run_dir / "grpo" / "metrics.jsonl")
    train = [r for r in records if r["phase"] == "train"]
    validation = [r for r in records if r["phase"] == "validation"]
    finished = train[-1]["step"] == GRPO_STEPS
    return {
        "after SFT": validation[0]["accuracy"],
        "accuracy": validation[-1]["accuracy"] if finished else None,
        "stopped": None if finished else train[-1]["step"] + 1,
        "seconds": train[-1]["time"] - train[0]["time"],
        "router_agreement": statistics.mean(r["moe/router_agreement"] for r in train),
        "token_mult_prob_error_max": max(r["token_mult_prob_error"] for r in train),
        "mismatch_kl_max": max(r["mismatch_kl"] for r in train),
        "mismatch_kl_mean": statistics.mean(r["mismatch_kl"] for r in train),
    }


def run_stage(run_dir: Path, seed: int, variant: str, **start: Any) -> dict[str, Any]:
    """One GRPO stage (after SFT on ``base_model``, or from ``sft_model``); a run the mismatch
    guard stops is a result, not an error."""
    from posttrain_grpo.mismatch import MismatchTooLarge
    from posttrain_quickstart.run import run_quickstart

    try:
        run_quickstart(run_dir, ["generation.backend=hf"], seed=seed, grpo_overrides=[*ENGINE, *VARIANTS[variant]], **start)
    except MismatchTooLarge as exc:
        print(f"seed {seed}, {variant}: {exc}")
    return stage_result(run_dir)


def run_seed(out: Path, seed: int) -> dict[str, Any]:
    from posttrain.testing.zoo import build_zoo_model

    seed_dir = out / f"seed_{seed}"
    measured_dir, replayed_dir = seed_dir / "measured", seed_dir / "replayed"

    def measured() -> dict[str, Any]:  # SFT on the MoE, then this variant's GRPO
        base = build_zoo_model(seed_dir / "base_model", "qwen3_moe", seed=seed, tokenizer="character", **MOE_SIZE)
        return run_stage(measured_dir, seed, "measured", base_model=base)

    row: dict[str, Any] = {"seed": seed, "measured": cached(measured_dir, measured)}
    row["replayed"] = cached(replayed_dir, lambda: run_stage(replayed_dir, seed, "replayed", sft_model=measured_dir / "sft_model"))
    row["after SFT"] = row["measured"]["after SFT"]
    return row


def _accuracy(stage: dict[str, Any]) -> str:
    return f"{stage['accuracy']:.3f}" if stage["stopped"] is None else f"stopped at step {stage['stopped']}"


def table(rows: list[dict[str, Any]]) -> str:
    names = list(VARIANTS)
    lines = ["| seed | after SFT | " + " | ".join(f"after GRPO, {n}" for n in names) + " | "
             + " | ".join(f"router agreement, {n}" for n in names) + " | "
             + " | ".join(f"max token_mult_prob_error / mean mismatch_kl, {n}" for n in names) + " | "
             + " | ".join(f"GRPO s, {n}" for n in names) + " |",
             "|---:|---:|" + "---:|" * (4 * len(names))]
    for row in rows:
        lines.append(f"| {row['seed']} | {row['after SFT']:.3f} | "
                     + " | ".join(_accuracy(row[n]) for n in names) + " | "
                     + " | ".join(f"{row[n]['router_agreement']:.4f}" for n in names) + " | "
                     + " | ".join(f"{row[n]['token_mult_prob_error_max']:.4f} / {row[n]['mismatch_kl_mean']:.2g}"
                                  for n in names) + " | "
                     + " | ".join(f"{row[n]['seconds']:.0f}" for n in names) + " |")
    both = [r for r in rows if all(r[n]["accuracy"] is not None for n in names)]
    if both:
        means = " | ".join(f"{statistics.mean(r[n]['accuracy'] for r in both):.3f}" for n in names)
        lines.append(f"| mean of the {len(both)} seeds both finished | {statistics.mean(r['after SFT'] for r in both):.3f} | "
                     f"{means} |" + " |" * (3 * len(names)))
    return ("The quickstart task on a Qwen3-MoE (8 experts, 2 per token): GRPO from the same SFT model, hf engine in "
            "bfloat16, trainer in float32, without routing replay (measured) and with it (replayed). Greedy accuracy "
            "on 256 held-out problems.\n\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/moe_replay")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(out, seed))
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))  # kept as the seeds finish
    text = table(rows)
    (out / "results.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
