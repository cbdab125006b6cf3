"""The quickstart task trained by variants of its RL stage, seed by seed, from the same SFT model.

    python benchmarks/quickstart_rl.py [--seeds 0 1 2] [--variants async async-no-is ppo]
                                       [--staleness 2] [--out runs/quickstart_rl]

For each seed: the quickstart (SFT, then synchronous GRPO with the engine colocated, its
defaults), then one more RL stage per variant from the same SFT model, with the same config
except the variant's overrides:

- ``async``: the engine on its own worker (``generation.colocated: false``) and
  ``grpo.asynchronous.max_staleness_steps: K``, with the default importance-sampling
  correction (TIS to [0, 2]);
- ``async-no-is``: the same with the correction off;
- ``ppo``: the ``ppo`` algorithm (a critic on the SFT model with a new value head, GAE)
  in place of GRPO's group baseline;
- ``hf``: synchronous GRPO with the hf engine (``generation.backend: hf``);
- ``exact``: the same with ``generation.exact_logprobs: true`` (the engine's logprobs are the
  trainer's, bit for bit; no previous-logprob pass).

Prints the greedy validation accuracy (256 held-out problems) after SFT and after each RL
stage, each stage's wall seconds (first to last step), the mean and max staleness of the
asynchronous runs, and each stage's largest ``token_mult_prob_error`` and ``mismatch_kl``
(engine against trainer) over its steps; writes ``results.json`` and ``results.md``. A stage whose ``result.json``
is already in ``--out`` is not run again, so a stopped run goes on where it stopped and new
variants reuse the seeds' SFT models.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: Each variant's RL algorithm and overrides, given the staleness bound K.
VARIANTS: dict[str, Callable[[int], tuple[str, list[str]]]] = {
    "async": lambda k: ("grpo", ["generation.colocated=false", f"grpo.asynchronous.max_staleness_steps={k}"]),
    "async-no-is": lambda k: ("grpo", ["generation.colocated=false", f"grpo.asynchronous.max_staleness_steps={k}",
                                       "grpo.asynchronous.importance_sampling_correction=false"]),
    # the critic: one more 1-CPU worker, trained on the policy's batch sizes at the policy's learning rate
    "ppo": lambda k: ("ppo", ["cluster.num_cpus=5", "ppo.critic.train_global_batch_size=64",
                              "ppo.critic.train_micro_batch_size=32", "ppo.critic.logprob_micro_batch_size=64",
                              "ppo.critic.max_total_sequence_length=48", "ppo.critic.optimizer.lr=5e-4"]),
    "hf": lambda k: ("grpo", ["generation.backend=hf"]),
    "exact": lambda k: ("grpo", ["generation.backend=hf", "generation.exact_logprobs=true"]),
}


def stage_result(run_dir: Path, accuracy: float) -> dict[str, Any]:
    """The RL stage's accuracy, wall seconds (first to last step), staleness and largest
    engine-trainer mismatch, from its metrics."""
    from posttrain.run.metrics import read_metrics

    train = read_metrics(run_dir / "grpo" / "metrics.jsonl", "train")
    return {
        "accuracy": accuracy,
        "seconds": train[-1]["time"] - train[0]["time"],
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in train),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in train),
        "token_mult_prob_error_max": max(r.get("token_mult_prob_error", float("nan")) for r in train),
        "mismatch_kl_max": max(r.get("mismatch_kl", float("nan")) for r in train),
    }


def cached(run_dir: Path, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run_dir/result.json`` if an earlier run wrote it; otherwise ``run()``, written there."""
    path = run_dir / "result.json"
    if path.is_file():
        return json.loads(path.read_text())
    result = run()
    path.write_text(json.dumps(result, indent=1))
    return result


def run_seed(out: Path, seed: int, variants: Mapping[str, tuple[str, list[str]]]) -> dict[str, Any]:
    """One seed's row: the quickstart's stages, then one RL stage per variant (its name: its
    algorithm and overrides) from the same SFT model."""
    from posttrain_quickstart.run import run_quickstart

    sync_dir = out / f"seed_{seed}" / "sync"

    def quickstart() -> dict[str, Any]:
        accuracies = run_quickstart(sync_dir, [], seed=seed)
        return {"after SFT": accuracies["after SFT"], **stage_result(sync_dir, accuracies["after GRPO"])}

    sync = cached(sync_dir, quickstart)
    row: dict[str, Any] = {"seed": seed, "after SFT": sync.pop("after SFT"), "sync": sync}
    for name, (algorithm, overrides) in variants.items():
        stage_dir = out / f"seed_{seed}" / name

        def variant(stage_dir: Path = stage_dir, algorithm: str = algorithm, overrides: list[str] = overrides) -> dict[str, Any]:
            result = run_quickstart(stage_dir, [], seed=seed, sft_model=sync_dir / "sft_model",
                                    grpo_overrides=overrides, rl_algorithm=algorithm)
            return stage_result(stage_dir, result["after GRPO"])

        row[name] = cached(stage_dir, variant)
    return row


def _mismatch(stage: dict[str, Any]) -> str:
    """A stage's largest token_mult_prob_error and mismatch_kl (results written before these
    were recorded have neither)."""
    if "token_mult_prob_error_max" not in stage:
        return "n/a"
    return f"{stage['token_mult_prob_error_max']:.7f} / {stage['mismatch_kl_max']:.2g}"


def table(rows: list[dict[str, Any]], variants: list[str], staleness: int) -> str:
    names = ["sync", *variants]
    asynchronous = [n for n in variants if n.startswith("async")]
    lines = [f"| seed | after SFT | {' | '.join(f'after RL, {n}' for n in names)} | "
             f"{' | '.join(f'RL s, {n}' for n in names)} |"
             + "".join(f" staleness mean / max, {n} |" for n in asynchronous)
             + "".join(f" max token_mult_prob_error / mismatch_kl, {n} |" for n in names),
             "|---:|---:|" + "---:|" * (3 * len(names) + len(asynchronous))]
    for row in rows:
        lines.append(f"| {row['seed']} | {row['after SFT']:.3f} | "
                     + " | ".join(f"{row[n]['accuracy']:.3f}" for n in names) + " | "
                     + " | ".join(f"{row[n]['seconds']:.0f}" for n in names) + " |"
                     + "".join(f" {row[n]['staleness_mean']:.2f} / {row[n]['staleness_max']:.0f} |" for n in asynchronous)
                     + "".join(f" {_mismatch(row[n])} |" for n in names))
    means = " | ".join(f"{statistics.mean(r[n]['accuracy'] for r in rows):.3f}" for n in names)
    lines.append(f"| mean | {statistics.mean(r['after SFT'] for r in rows):.3f} | {means} |"
                 + " |" * (2 * len(names) + len(asynchronous)))
    return (f"The quickstart task's RL stage: sync = the quickstart's synchronous GRPO (colocated engine); "
            f"{', '.join(variants)} from the same SFT model (asynchronous: max_staleness_steps={staleness}, engine on its "
            f"own worker). Greedy accuracy on 256 held-out problems.\n\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["async", "async-no-is"])
    parser.add_argument("--staleness", type=int, default=2, help="max_staleness_steps of the asynchronous variants")
    parser.add_argument("--out", default="runs/quickstart_rl")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(out, seed, {name: VARIANTS[name](args.staleness) for name in args.variants}))
        (out / "results.json").write_text(json.dumps(rows, indent=1))  # kept as the seeds finish
    text = table(rows, args.variants, args.staleness)
    (out / "results.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
