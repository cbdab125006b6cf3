"""Training throughput of the dtensor policy with and without sequence packing.

Run on demand (not a test)::

    python benchmarks/dtensor_packing.py --size small --samples 16 --max-len 256

Builds a tiny Llama locally, starts a dtensor policy on a local Ray cluster and trains on
one global batch of skewed lengths (most samples short, a few long), timing optimizer
steps three ways: padded microbatches, dynamic batching by a token budget, and sequence
packing. It reports real (non-padding) training tokens per second and model FLOPs
utilisation: useful model FLOPs (6 x matmul parameters per token plus causal attention,
forward and backward, real tokens only) per second, divided by this machine's float32
matmul rate measured in the same run with a large ``torch.mm`` on all cores (both from
``common.py``).

CPU only: each worker gets ``cores / workers`` threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from posttrain.backend.work import Batching, plan_pass
from posttrain.batch import Batch
from posttrain.config.schema import (
    DynamicBatchingConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    SequencePackingConfig,
    WorkerResources,
)
from posttrain.models.tiny import build_tiny_model
from posttrain.plugins import plugin_host

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import forward_flops, matmul_flops_per_s, skewed_lengths  # noqa: E402


def make_batch(lengths: list[int], vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    pos = torch.arange(width)[None, :]
    lens = torch.tensor(lengths)
    real = pos < lens[:, None]
    ids = torch.randint(7, vocab, (len(lengths), width), generator=g) * real
    return Batch(input_ids=ids, input_lengths=lens, token_mask=(real & (pos >= 1)).float(),
                 sample_mask=torch.ones(len(lengths)))


def processed_tokens(lengths: list[int], dp: int, batching: Batching) -> tuple[int, int]:
    """(microbatches per rank, tokens the model runs on incl. padding) for this batching."""
    plan = plan_pass(lengths, dp, batching)
    total = 0
    for shard, mbs in zip(plan.shards, plan.microbatches, strict=True):
        for mb in mbs:
            lens = [lengths[shard[i]] for i in mb]
            if batching.packing_tokens_per_row is not None:
                r = batching.round_to
                total += -(-sum(lens) // r) * r
            else:
                total += len(lens) * max(lens)
    return len(plan.microbatches[0]), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="posttrain.models.tiny size preset")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for key, value in {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)

    import ray
    from transformers import AutoConfig

    from posttrain.config.schema import ClusterConfig
    from posttrain.distributed import VirtualCluster
    from posttrain_dtensor.policy import DTensorPolicy

    peak = matmul_flops_per_s()
    cores = os.cpu_count() or 1
    threads = max(1, cores // args.workers)
    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="dtensor_bench_"), size=args.size, seed=args.seed)
    hf_config = AutoConfig.from_pretrained(model_dir)
    lengths = skewed_lengths(args.samples, args.max_len, args.seed)
    batch = make_batch(lengths, hf_config.vocab_size, args.seed)
    budget = args.micro_batch_size * args.max_len
    modes = {
        "padded": (SequencePackingConfig(), DynamicBatchingConfig(), Batching(args.micro_batch_size)),
        "dynamic": (SequencePackingConfig(), DynamicBatchingConfig(enabled=True, max_tokens_per_microbatch=budget),
                    Batching(args.micro_batch_size, dynamic_max_tokens=budget)),
        "packed": (SequencePackingConfig(enabled=True, max_tokens_per_row=budget), DynamicBatchingConfig(),
                   Batching(args.micro_batch_size, packing_tokens_per_row=budget)),
    }
    config = RunConfig(
        seed=args.seed,
        cluster=ClusterConfig(num_cpus=cores * 2),
        policy=PolicyConfig(
            model=str(model_dir),
            num_workers=args.workers,
            train_global_batch_size=args.samples,
            train_micro_batch_size=args.micro_batch_size,
            max_total_sequence_length=args.max_len,
            optimizer=OptimizerConfig(name="adamw", lr=1e-5),
            resources=WorkerResources(cpus=threads, env_vars={"OMP_NUM_THREADS": str(threads)}),
        ),
    )
    loss_fn = plugin_host().losses["nll"](None)
    ray.init(address="local", num_cpus=cores * 2, include_dashboard=False, log_to_driver=False)
    policy = DTensorPolicy(config, VirtualCluster(config.cluster))
    try:
        params = policy.info()["parameters"]
        flops = 3 * forward_flops(hf_config, lengths)  # forward + backward, real tokens
        rows = []
        for name, (packing, dynamic, batching) in modes.items():
            policy.config.policy.sequence_packing = packing
            policy.config.policy.dynamic_batching = dynamic
            for _ in range(args.warmup):
                policy.train(batch, loss_fn)
            times = [policy.train(batch, loss_fn)["step_time_s"] for _ in range(args.steps)]
            step_s = sorted(times)[len(times) // 2]
            microbatches, processed = processed_tokens(lengths, policy.dp_size, batching)
            rows.append((name, microbatches, processed, step_s, sum(lengths) / step_s, flops / step_s / peak))
    finally:
        policy.shutdown()
        ray.shutdown()

    print(f"\nmodel: {args.size} ({params / 1e6:.1f}M parameters), {args.workers} worker(s) x {threads} thread(s)")
    print(f"batch: {args.samples} samples, lengths {min(lengths)}..{max(lengths)} "
          f"(mean {sum(lengths) / len(lengths):.0f}), {sum(lengths)} real tokens; token budget {budget}")
    print(f"float32 matmul rate (torch.mm 2048^2, {cores} threads): {peak / 1e9:.1f} GFLOP/s; "
          f"model FLOPs per step: {flops / 1e9:.2f} GFLOP\n")
    header = f"{'mode':<8} {'microbatches':>12} {'tokens run':>11} {'padding':>8} {'step s':>8} {'tokens/s':>9} {'MFU':>7}"
    print(header)
    print("-" * len(header))
    for name, microbatches, processed, step_s, tps, mfu in rows:
        padding = 1 - sum(lengths) / processed
        print(f"{name:<8} {microbatches:>12} {processed:>11} {padding:>8.1%} {step_s:>8.3f} {tps:>9.0f} {mfu:>7.1%}")


if __name__ == "__main__":
    main()
