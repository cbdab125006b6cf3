"""Driver memory and time per GRPO step with each data plane, as the batch grows.

Run on demand (not a test)::

    python benchmarks/data_plane_memory.py --sizes 64 256 1024 --steps 3

One step moves what a GRPO step moves, through the same code a GRPO run uses: the rollout
(``input_ids`` [B, L] int64, lengths, generation logprobs, token and sample masks, rewards,
advantages, message logs with token ids) is put with ``keep``/``length`` tags; the ``keep``
tags are read (dynamic sampling); a :class:`~posttrain.backend.policy_driver.ShardedPolicy` over
two Ray workers then writes previous and reference logprobs of the kept samples into the
plane (:meth:`~posttrain.interfaces.Policy.logprobs_into`) and runs a train pass on them
(:meth:`~posttrain.interfaces.Policy.train_from`); the partition is cleared. The workers are
stand-ins (random logprobs, a train pass that only reads its shard), so the times are the
data movement's. With the ``memory`` plane the driver materialises every pass's batch and
sends it to the workers, and receives the logprobs; with ``transferqueue`` the workers fetch
their shards and write their logprobs themselves, and the driver reads only lengths.

Each plane runs in its own process so its resident memory is its own. Reported per batch
size: mean milliseconds per step in the put, in the two logprob passes and in the train
pass; the driver memory the plane holds while the step is live (resident memory after the
put with the rollout freed, minus before the rollout was built); the driver's peak resident
memory above its start (ru_maxrss, so it only grows over a run); and, for TransferQueue, the
resident memory of its storage units, where the samples went instead.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import attrs
import psutil
import torch

from posttrain.backend.policy_driver import ShardedPolicy
from posttrain.backend.policy_worker import PolicyWorker
from posttrain.batch import Batch
from posttrain.config.schema import ClusterConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster, WorkerGroup
from posttrain.interfaces import LossFunction, PlaneSamples
from posttrain.plugins import plugin_host

MIB = 2**20
WORKERS = 2  # data-parallel stand-in policy workers
LOGPROB_FIELDS = ["input_ids", "input_lengths", "token_mask", "sample_mask"]
TRAIN_FIELDS = [*LOGPROB_FIELDS, "advantages", "generation_logprobs", "prev_logprobs", "reference_logprobs"]
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform == "linux" else None


def rss() -> int:
    """Resident bytes of this process after handing freed heap pages back to the OS, so
    memory the allocator merely keeps cached does not count as held."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rollout(batch: int, length: int, seed: int) -> tuple[list[str], dict[str, Any], dict[str, torch.Tensor]]:
    """Keys, fields and tags of one step's rollout: prompts of 1/4 of ``length``, 4
    generations per prompt, responses of random length."""
    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    lengths = torch.randint(prompt + 8, length + 1, (batch,), generator=g)
    positions = torch.arange(length)
    valid = positions[None, :] < lengths[:, None]
    token_mask = valid & (positions[None, :] >= prompt)
    input_ids = torch.randint(3, 32000, (batch, length), generator=g) * valid
    rewards = (torch.rand(batch, generator=g) > 0.5).float()
    groups = rewards.view(-1, 4)
    advantages = (groups - groups.mean(1, keepdim=True)).view(-1)
    keep = groups.std(1).repeat_interleave(4) > 0  # dynamic sampling drops zero-variance groups
    logs = [
        [
            {"role": "user", "content": "What is 17 * 23? Think step by step." * 4, "token_ids": input_ids[i, :prompt]},
            {"role": "assistant", "content": "17 * 23 = 391. " * 20, "token_ids": input_ids[i, prompt : lengths[i]]},
        ]
        for i in range(batch)
    ]
    fields = {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "generation_logprobs": -torch.rand(batch, length, generator=g) * token_mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch),
        "rewards": rewards,
        "advantages": advantages,
        "message_log": logs,
    }
    keys = [f"p{i // 4}_g{i % 4}" for i in range(batch)]
    return keys, fields, {"keep": keep, "length": lengths.to(torch.int32)}


def storage_rss() -> int | None:
    """Resident memory of TransferQueue's storage units (None when it is not running here)."""
    tq_state = sys.modules.get("transfer_queue.interface")  # never imported by the memory plane
    client = tq_state._TQ_CLIENT if tq_state is not None else None
    if client is None:
        return None
    manager = client.storage_manager
    probes = [manager._probe_storage_unit(target_storage_unit=unit) for unit in manager.storage_unit_infos]
    return sum(client._run_coroutine(probe)["process_rss_bytes"] for probe in probes)


class StandInWorker(PolicyWorker):
    """A policy rank that reads its shard like a real one and computes nothing worth timing;
    the benchmark never calls the methods that hold or export weights."""

    def logprobs(self, work: Any, reference: bool = False) -> Batch:
        shape = work.batch["input_ids"].shape
        return Batch({"reference_logprobs" if reference else "logprobs": -torch.rand(shape)})

    def train(self, work: Any, loss_fn: Any, eval_mode: bool = False) -> dict[str, Any]:
        tokens = float(work.batch["token_mask"].sum())
        return {"loss": 0.0, "metrics": {}, "num_tokens": tokens, "lr": 0.0, "grad_norm": 0.0, "step_time_s": 0.0}

    def topk(self, work: Any, k: int) -> Batch:
        raise NotImplementedError("the data-plane benchmark runs logprob and train passes only")

    save_checkpoint = load_checkpoint = weight_metadata = gather_weights = export_hf = info = topk


class NoLoss(LossFunction):
    def __call__(self, logprobs: Any, batch: Any, global_valid_seqs: Any, global_valid_toks: Any) -> Any:
        raise NotImplementedError("the stand-in workers never call the loss")


def stand_in_policy(config: RunConfig, cluster: VirtualCluster, batch: int) -> ShardedPolicy:
    """A ShardedPolicy over :class:`StandInWorker` ranks, one microbatch per rank and pass."""
    per_rank = max(1, batch // WORKERS)
    policy = PolicyConfig(num_workers=WORKERS, train_global_batch_size=batch, train_micro_batch_size=per_rank,
                          logprob_micro_batch_size=per_rank, resources=WorkerResources(cpus=0.5))
    group = WorkerGroup(cluster, StandInWorker, name="stand-in-policy", num_workers=WORKERS, resources=policy.resources)
    return ShardedPolicy(attrs.evolve(config, policy=policy), group, list(range(WORKERS)), list(range(WORKERS)))


def run_step(plane: Any, policy: ShardedPolicy, batch: int, length: int, seed: int) -> dict[str, float]:
    """One step of ``batch`` samples through ``plane`` and ``policy``: seconds in the put,
    the logprob passes and the train pass; driver bytes held while the step is live;
    storage-unit bytes; rollout tensor bytes."""
    before = rss()
    keys, fields, tags = rollout(batch, length, seed)
    rollout_bytes = sum(value.nbytes for value in fields.values() if isinstance(value, torch.Tensor))
    partition = f"train/{batch}/{seed}"
    started = time.perf_counter()
    plane.put(partition, keys, fields, tags=tags)
    put_s = time.perf_counter() - started
    del fields
    held = rss() - before
    storage = storage_rss()
    keep = plane.tags(partition)["keep"].tolist()
    kept = [key for key, flag in zip(keys, keep, strict=True) if flag]
    kept = kept[: len(kept) // WORKERS * WORKERS]  # a train pass needs a multiple of the data-parallel size
    started = time.perf_counter()
    policy.logprobs_into(PlaneSamples(plane, partition, kept, LOGPROB_FIELDS), "prev_logprobs")
    policy.logprobs_into(PlaneSamples(plane, partition, kept, LOGPROB_FIELDS), "reference_logprobs", reference=True)
    logprobs_s = time.perf_counter() - started
    started = time.perf_counter()
    policy.train_from(PlaneSamples(plane, partition, kept, TRAIN_FIELDS), NoLoss())
    train_s = time.perf_counter() - started
    plane.clear(partition)
    return {"put_s": put_s, "logprobs_s": logprobs_s, "train_s": train_s, "held": held, "storage": storage,
            "rollout": rollout_bytes}


def measure(plane_name: str, sizes: list[int], steps: int, length: int) -> list[dict[str, Any]]:
    """Run ``steps`` steps per batch size on a fresh plane; one result row per size."""
    config = RunConfig(run_dir=tempfile.mkdtemp(prefix="data_plane_bench_"), cluster=ClusterConfig(num_cpus=4))
    plane = plugin_host().data_planes[plane_name](config)  # starts Ray with the config's cluster
    cluster = VirtualCluster(config.cluster)
    rows = []
    try:
        start_peak = peak_rss()
        for batch in sizes:
            policy = stand_in_policy(config, cluster, batch)
            run_step(plane, policy, batch, length, -1)  # warm up (TransferQueue: the workers attach)
            results = [run_step(plane, policy, batch, length, step) for step in range(steps)]
            policy.shutdown()
            storage = [r["storage"] for r in results if r["storage"] is not None]
            rows.append(
                {
                    "plane": plane_name,
                    "batch": batch,
                    "rollout_mib": results[0]["rollout"] / MIB,
                    "put_ms": 1000 * statistics.mean(r["put_s"] for r in results),
                    "logprobs_ms": 1000 * statistics.mean(r["logprobs_s"] for r in results),
                    "train_ms": 1000 * statistics.mean(r["train_s"] for r in results),
                    "held_mib": statistics.median(r["held"] for r in results) / MIB,
                    "peak_mib": (peak_rss() - start_peak) / MIB,
                    "storage_mib": max(storage) / MIB if storage else None,
                }
            )
    finally:
        plane.shutdown()
        cluster.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", nargs="+", default=["memory", "transferqueue"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--length", type=int, default=512, help="tokens per sample (prompt + response)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one plane, print JSON rows
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, sorted(args.sizes), args.steps, args.length)))
        return
    rows = []
    for plane in args.planes:
        command = [sys.executable, __file__, "--child", plane, "--steps", str(args.steps), "--length", str(args.length)]
        done = subprocess.run([*command, "--sizes", *map(str, args.sizes)], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"plane '{plane}' failed:\n{done.stderr[-4000:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    header = f"{'plane':<14}{'batch':>6}{'rollout MiB':>13}{'put ms':>9}{'logprobs ms':>13}{'train ms':>10}"
    print(header + f"{'held MiB':>10}{'peak +MiB':>11}{'storage MiB':>13}")
    for row in rows:
        storage = "-" if row["storage_mib"] is None else f"{row['storage_mib']:.0f}"
        print(
            f"{row['plane']:<14}{row['batch']:>6}{row['rollout_mib']:>13.1f}{row['put_ms']:>9.1f}"
            f"{row['logprobs_ms']:>13.1f}{row['train_ms']:>10.1f}{row['held_mib']:>10.1f}{row['peak_mib']:>11.1f}"
            f"{storage:>13}"
        )


if __name__ == "__main__":
    main()
