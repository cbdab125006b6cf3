"""Where one posttrain training step's time goes: the dtensor worker's real ``train`` in
this process (world size 1, no Ray) under ``torch.profiler``, on a benchmark's data.

    python benchmarks/profile_step.py --spec RUN_DIR/spec.json [--padded] [--steps 2]
    python benchmarks/profile_step.py --spec RUN_DIR/spec.json --row-tokens 32768,2816 [--reps 2]

``RUN_DIR`` is the ``--out`` folder of ``sft.py`` (SFT data: the NLL step), of ``dpo.py``
(preference pairs: the reference-logprob pass with the reference weights swapped in, then
the sigmoid DPO step) or of ``grpo.py`` (its prompts, 8 times each, with completions of
random tokens whose lengths follow the run's form: geometric at the benchmark's EOS rate,
capped at the run's budget (64 unless ``--max-new-tokens`` set another), or all of it; the
clipped policy-gradient step with random advantages, on policy). After one warm-up step it
times ``--steps`` steps without the profiler, then runs the same steps again under it (the
profiler added 10 to 30% to the small model's GRPO step here). Prints the unprofiled step time, the floor
(training FLOPs of the real tokens / this machine's float32 ``torch.mm`` rate, measured
here), and the profiled steps' operators by self CPU time: the share in matrix products (the
floor's work) versus everything else. The spec's data must hold ``1 + --steps`` batches.

With ``--row-tokens``, no profile: the same worker trains the same steps packed in rows of
each listed size in turn (``--reps`` rounds, sizes alternating) and prints each size's
median seconds per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import forward_flops, matmul_flops_per_s  # noqa: E402
from grpo import EOS_RATE, GENERATIONS, MAX_NEW_TOKENS  # noqa: E402

from posttrain.batch import Batch  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--padded", action="store_true", help="padded microbatch instead of sequence packing")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps (after one warm-up step)")
    parser.add_argument("--row-tokens", help="comma-separated packed row sizes (tokens) to compare instead of profiling")
    parser.add_argument("--reps", type=int, default=2, help="rounds over --row-tokens")
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(spec["threads"])

    from transformers import AutoConfig

    from posttrain.backend.work import Batching, plan_pass
    from posttrain.config import config_from_dict
    from posttrain.data import dataloader_from_config, dataset_from_config, encoder_from_config
    from posttrain_dtensor.config import DTensorConfig
    from posttrain_dtensor.worker import DTensorPolicyWorker

    rows, workload = spec["rows_per_step"], spec["workload"]
    config = config_from_dict({
        "algorithm": workload, "seed": spec["seed"], "run_dir": str(Path(spec["workdir"]) / "profile"),
        "policy": {
            "backend": "dtensor", "model": spec["model_dir"], "dtype": "float32", "train_global_batch_size": rows,
            "train_micro_batch_size": rows, "max_total_sequence_length": spec["max_len"],
            "sequence_packing": {"enabled": not args.padded, "max_tokens_per_row": rows * spec["max_len"]},
            "optimizer": {"name": "adamw", "lr": spec["lr"]},
        },
        "data": {"train": spec["data"], "shuffle": False, "max_length": spec["max_len"]},
    }, source="profile")
    reference = workload == "dpo"
    if workload == "grpo":
        from posttrain_grpo.config import ClippedPGConfig
        from posttrain_grpo.loss import ClippedPGLoss

        dataset = dataset_from_config(config, "train", "prompt", encoder_from_config(config))
        loader = dataloader_from_config(config, dataset, rows // GENERATIONS)
        batches = [rollout_batch(prompts, spec) for prompts in itertools.islice(loader, 1 + args.steps)]
        loss_fn = ClippedPGLoss(ClippedPGConfig())
    else:
        from posttrain_dpo.loss import DPOLoss
        from posttrain_sft.loss import NLLLoss

        kind, loss_fn = ("preference", DPOLoss(beta=0.1)) if reference else ("sft", NLLLoss())
        dataset = dataset_from_config(config, "train", kind, encoder_from_config(config))
        per_row = 2 if reference else 1
        batches = list(itertools.islice(dataloader_from_config(config, dataset, rows // per_row), 1 + args.steps))
    if len(batches) < 1 + args.steps:
        raise SystemExit(f"{args.spec}: its data holds {len(batches)} batches of {rows} rows; --steps {args.steps} needs "
                         f"{1 + args.steps} (one warm-up step first). Use --steps {len(batches) - 1} or less.")
    worker = DTensorPolicyWorker(config, DTensorConfig())
    batching = Batching.from_policy_config(config.policy, rows)

    def step(batch, batching=batching):
        work = plan_pass(batch["input_lengths"].tolist(), 1, batching).work(batch)[0]
        if reference:
            work.batch["reference_logprobs"] = worker.logprobs(work, reference=True)["reference_logprobs"]
        return worker.train(work, loss_fn)

    def seconds_per_step() -> float:
        start = time.perf_counter()
        for batch in batches[1:]:
            step(batch)
        return (time.perf_counter() - start) / args.steps

    step(batches[0])
    if args.row_tokens:
        compare_row_sizes(step, batches[1:], [int(n) for n in args.row_tokens.split(",")], rows, args.reps)
        return
    elapsed = seconds_per_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = seconds_per_step()
    hf = AutoConfig.from_pretrained(spec["model_dir"])
    passes = 4 if reference else 3  # training, plus DPO's reference forward
    flops = sum(passes * forward_flops(hf, b["input_lengths"].tolist()) for b in batches[1:]) / args.steps
    rate = matmul_flops_per_s(threads=spec["threads"])
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    print(f"mode: {'padded' if args.padded else 'packed'}; step {elapsed:.3f} s ({elapsed / (flops / rate):.2f}x the "
          f"floor {flops / rate:.3f} s: {flops / 1e9:.1f} GFLOP at {rate / 1e9:.1f} GFLOP/s); "
          f"{profiled:.3f} s under the profiler; load {os.getloadavg()[0]:.1f}")
    print(f"self CPU time in matrix products ({', '.join(MATMUL_OPS)}), profiled steps: {matmul / total:.1%}; "
          f"matrix products alone run at {flops / (matmul / 1e6 / args.steps) / 1e9:.2f} GFLOP/s")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


def compare_row_sizes(step, batches: list[Batch], sizes: list[int], rows: int, reps: int) -> None:
    """Seconds per ``step(batch, batching)`` (the same step the profile times) with each packed
    row size, sizes alternating, ``reps`` rounds."""
    from posttrain.backend.work import Batching

    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(reps):
        for size in sizes:
            batching = Batching(rows, packing_tokens_per_row=size)
            for batch in batches:
                start = time.perf_counter()
                step(batch, batching)
                times[size].append(time.perf_counter() - start)
    print(f"load {os.getloadavg()[0]:.1f}; seconds per step by tokens per packed row (median, then every step):")
    for size in sizes:
        print(f"{size:>8}  {statistics.median(times[size]):.3f}  {' '.join(f'{t:.2f}' for t in times[size])}")


def rollout_batch(prompts: Batch, spec: dict) -> Batch:
    """A GRPO step's training batch without generating: each prompt ``GENERATIONS`` times
    with a completion of random tokens (lengths as the run's ``form`` samples them), loss on
    the completion, random advantages."""
    g = torch.Generator().manual_seed(spec["seed"])
    lengths = prompts["input_lengths"].repeat_interleave(GENERATIONS)
    n, budget = len(lengths), spec.get("max_new_tokens", MAX_NEW_TOKENS)
    if spec["form"] == "dense":
        completions = torch.full((n,), budget)
    else:  # the number of tokens up to and including the first EOS, at most the budget
        completions = (torch.log(torch.rand(n, generator=g)) / math.log(1 - EOS_RATE)).ceil().clamp(1, budget).long()
    total = lengths + completions
    ids = torch.randint(3, 100, (n, int(total.max())), generator=g)
    ids[:, : prompts["input_ids"].shape[1]] = prompts["input_ids"].repeat_interleave(GENERATIONS, dim=0)[:, : ids.shape[1]]
    positions = torch.arange(ids.shape[1])[None, :]
    mask = ((positions >= lengths[:, None]) & (positions < total[:, None])).float()
    return Batch(input_ids=ids, input_lengths=total, token_mask=mask, sample_mask=torch.ones(n),
                 advantages=torch.randn(n, generator=g))


if __name__ == "__main__":
    main()
