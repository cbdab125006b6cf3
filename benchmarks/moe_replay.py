"""The quickstart task on a mixture of experts, GRPO with and without routing replay.

    python benchmarks/moe_replay.py [--seeds 0 1 2] [--out runs/moe_replay]

For each seed: a Qwen3-MoE of the quickstart's size (hidden 128, 4 layers, 8 experts of which
2 per token, the character tokenizer) fine-tuned by the quickstart's SFT, then two GRPO stages
from that SFT model with the hf engine sampling in bfloat16 (the trainer in float32, as a GPU
run's engine and master weights): ``measured`` records the rollout's experts and reports the
routers' agreement without replaying them (``policy.moe.router_agreement``), ``replayed``
replays them (``policy.moe.routing_replay: rollout``). Prints the greedy validation accuracy
(256 held-out problems) after SFT and after each GRPO stage, each stage's mean router agreement,
largest ``token_mult_prob_error`` and ``mismatch_kl`` and wall seconds; writes ``results.json``
and ``results.md``. A stage whose ``result.json`` is in ``--out`` is not run again.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from quickstart_rl import cached

#: The engine in bfloat16, the trainer in float32, and the variant's ``policy.moe``.
ENGINE = ["generation.backend=hf", "generation.dtype=bfloat16"]
VARIANTS = {"measured": ["policy.moe.router_agreement=true"], "replayed": ["policy.moe.routing_replay=rollout"]}
#: The quickstart Llama's size, as a Qwen3-MoE.
MOE_SIZE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, initializer_range=0.02)


def stage_result(run_dir: Path, accuracy: float) -> dict[str, Any]:
    from posttrain.run.metrics import read_metrics

    train = read_metrics(run_dir / "grpo" / "metrics.jsonl", "train")
    return {
        "accuracy": accuracy,
        "seconds": train[-1]["time"] - train[0]["time"],
        "router_agreement": statistics.mean(r["moe/router_agreement"] for r in train),
        "token_mult_prob_error_max": max(r["token_mult_prob_error"] for r in train),
        "mismatch_kl_max": max(r["mismatch_kl"] for r in train),
        "mismatch_kl_mean": statistics.mean(r["mismatch_kl"] for r in train),
    }


def run_seed(out: Path, seed: int) -> dict[str, Any]:
    from posttrain.testing.zoo import build_zoo_model
    from posttrain_quickstart.run import run_quickstart

    seed_dir = out / f"seed_{seed}"
    measured_dir = seed_dir / "measured"

    def first() -> dict[str, Any]:  # SFT on the MoE, then the first variant's GRPO
        base = build_zoo_model(seed_dir / "base_model", "qwen3_moe", seed=seed, tokenizer="character", **MOE_SIZE)
        accuracies = run_quickstart(measured_dir, ["generation.backend=hf"], seed=seed, base_model=base,
                                    grpo_overrides=[*ENGINE, *VARIANTS["measured"]])
        return {"after SFT": accuracies["after SFT"], **stage_result(measured_dir, accuracies["after GRPO"])}

    measured = cached(measured_dir, first)
    row: dict[str, Any] = {"seed": seed, "after SFT": measured.pop("after SFT"), "measured": measured}
    replayed_dir = seed_dir / "replayed"

    def replayed() -> dict[str, Any]:
        accuracies = run_quickstart(replayed_dir, ["generation.backend=hf"], seed=seed, sft_model=measured_dir / "sft_model",
                                    grpo_overrides=[*ENGINE, *VARIANTS["replayed"]])
        return stage_result(replayed_dir, accuracies["after GRPO"])

    row["replayed"] = cached(replayed_dir, replayed)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    names = list(VARIANTS)
    lines = ["| seed | after SFT | " + " | ".join(f"after GRPO, {n}" for n in names) + " | "
             + " | ".join(f"router agreement, {n}" for n in names) + " | "
             + " | ".join(f"max token_mult_prob_error / mean mismatch_kl, {n}" for n in names) + " | "
             + " | ".join(f"GRPO s, {n}" for n in names) + " |",
             "|---:|---:|" + "---:|" * (4 * len(names))]
    for row in rows:
        lines.append(f"| {row['seed']} | {row['after SFT']:.3f} | "
                     + " | ".join(f"{row[n]['accuracy']:.3f}" for n in names) + " | "
                     + " | ".join(f"{row[n]['router_agreement']:.4f}" for n in names) + " | "
                     + " | ".join(f"{row[n]['token_mult_prob_error_max']:.4f} / {row[n]['mismatch_kl_mean']:.2g}"
                                  for n in names) + " | "
                     + " | ".join(f"{row[n]['seconds']:.0f}" for n in names) + " |")
    means = " | ".join(f"{statistics.mean(r[n]['accuracy'] for r in rows):.3f}" for n in names)
    lines.append(f"| mean | {statistics.mean(r['after SFT'] for r in rows):.3f} | {means} |" + " |" * (3 * len(names)))
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
