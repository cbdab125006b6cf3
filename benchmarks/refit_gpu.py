"""Refit on one CUDA GPU: the dtensor policy and a colocated ``hf`` engine share the GPU
(half each); the sync goes through CUDA IPC (``generation.weight_transport: auto``) or
through CPU memory over gloo (``gloo``). Needs a CUDA GPU; not part of CI.

    python benchmarks/refit_gpu.py [--size medium] [--reps 5]

Prints, per transport, the median of ``--reps`` refits (after one untimed), the bytes moved,
and the floor: one device-to-device copy of those bytes on the same GPU (CUDA events). After
the last refit the engine's logprobs are checked against the trainer's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from posttrain.batch import Batch
from posttrain.config.schema import ClusterConfig, GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.distributed.cluster import colocated_groups
from posttrain.models.tiny import SIZES, build_tiny_model
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import generated_mask, prompt_batch

HALF_GPU = WorkerResources(cpus=1, gpus=0.5)
PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9], [1, 12]]


def copy_floor_s(nbytes: int) -> float:
    """Seconds of one device-to-device copy of ``nbytes`` (median of 5, after a warm-up)."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times[1:])


def measure(model: str, transport: str, reps: int) -> dict[str, float | str]:
    config = RunConfig(
        seed=1, cluster=ClusterConfig(use_gpus=True),
        policy=PolicyConfig(model=model, train_global_batch_size=4, train_micro_batch_size=2,
                            max_total_sequence_length=64, resources=HALF_GPU),
        generation=GenerationConfig(backend="hf", max_new_tokens=8, weight_transport=transport, resources=HALF_GPU),
    )
    cluster = VirtualCluster(config.cluster, colocate=colocated_groups(config))
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    generation = plugin_host().generation_backends["hf"](config, cluster)
    try:
        stats = [refit(policy, generation, config.generation.refit_bucket_bytes, version=v) for v in range(reps + 1)][1:]
        out = generation.generate(prompt_batch(PROMPTS))
        mask = generated_mask(out, PROMPTS)
        theirs = policy.get_logprobs(Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]))
        return {"transport": stats[0].transport, "seconds": statistics.median(s.seconds for s in stats),
                "bytes": stats[0].bytes_moved, "buckets": stats[0].num_buckets,
                "max_logprob_difference": float((out["logprobs"] - theirs["logprobs"])[mask].abs().max())}
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="medium", choices=sorted(SIZES))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/refit_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    model = str(build_tiny_model(tempfile.mkdtemp(prefix="refit-gpu-"), size=args.size))
    rows = [measure(model, transport, args.reps) for transport in ("auto", "gloo")]
    floor = copy_floor_s(int(rows[0]["bytes"]))
    print(f"{torch.cuda.get_device_name()}, model {args.size} ({int(rows[0]['bytes']) / 1e6:.0f} MB), "
          f"device-to-device copy floor {floor * 1e3:.2f} ms")
    print("| transport | refit s (median) | x floor | buckets | max logprob difference |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['transport']} | {row['seconds']:.4f} | {row['seconds'] / floor:.1f} | {row['buckets']} "
              f"| {row['max_logprob_difference']:.1e} |")


if __name__ == "__main__":
    run()
