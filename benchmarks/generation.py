"""Generation alone: posttrain's vllm and hf backends against TRL's generation path.

    python benchmarks/generation.py --model small --form skewed --reps 2 --out DIR

One call samples 8 completions of each of 16 prompts (128 rows, each prompt's copies next
to each other as a GRPO step sends them), at most ``--max-new-tokens`` (64) new tokens,
temperature 1.0, no top-p / top-k, float32. ``--form dense``: every completion is exactly
64 tokens (posttrain ``generation.ignore_eos: true``; TRL ``generation_kwargs={"min_new_tokens": 64}``);
``--form skewed``: completions end at EOS; the model gets the EOS rate of ``grpo.py``'s skewed
form (:data:`EOS_RATE` per token, :func:`common.set_eos_rate`).

Sides, each in its own process:

- ``posttrain-vllm`` (the baseline): the ``vllm`` generation backend as a GRPO run builds
  it (a Ray engine actor with the in-process engine, through ``WorkerGroupGeneration``);
- ``posttrain-hf``: the ``hf`` backend (its own batched decode loop), same path;
- ``trl``: ``GRPOTrainer``'s default generation path, driven through the trainer itself
  (``_generate_single_turn``: left padding, ``model.generate`` with the
  ``GenerationConfig`` TRL builds, masking after the first EOS).

Timed: every ``generate`` call after ``--warmup`` untimed ones (prepare, generate and finish
for posttrain; the whole trainer method for TRL). Floor of a call: a forward pass over every
row's prompt + completion tokens (:func:`common.forward_flops`) at the machine's float32
matmul rate measured in the same run. See docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Workload,
    _machine,
    _parameters,
    forward_flops,
    length_stats,
    main,
    random_text,
    set_eos_rate,
    skewed_lengths,
    step_record,
    weights_digest,
)

# A call is one GRPO step's generation: PROMPTS prompts x GENERATIONS completions each, and
# the skewed form's model has the GRPO benchmark's EOS rate.
from grpo import EOS_RATE, GENERATIONS, PROMPTS  # noqa: E402

# ---------------------------------------------------------------------- data


def prepare_model(spec: dict[str, Any], model_dir: Path) -> None:
    """Skewed form: give the model its EOS rate (the measured rate goes into the spec)."""
    if spec["form"] == "skewed":
        spec["eos_rate_measured"] = set_eos_rate(model_dir, EOS_RATE, seed=spec["seed"])


def write_prompts(spec: dict[str, Any], path: Path) -> None:
    """``PROMPTS`` prompts (one JSON list of token ids a line): BOS then random characters,
    lengths from :func:`common.skewed_lengths` up to ``--max-len`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    g = torch.Generator().manual_seed(spec["seed"])
    with path.open("w") as f:
        for length in skewed_lengths(PROMPTS, spec["max_len"], spec["seed"]):
            ids = tokenizer(random_text(length - 1, g), add_special_tokens=False)["input_ids"]
            f.write(json.dumps([tokenizer.bos_token_id, *ids]) + "\n")


def read_rows(spec: dict[str, Any]) -> list[list[int]]:
    """The rows of one call: every prompt of ``spec["data"]`` ``GENERATIONS`` times, copies adjacent."""
    prompts = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    return [p for p in prompts for _ in range(GENERATIONS)]


# ---------------------------------------------------------------------- what a child reports


def sampling_settings(*, rows: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int | None,
                      stop_token_ids: Sequence[int], dtype: Any) -> dict[str, Any]:
    """The settings every side must share, normalised: ``top_k`` 0 or None is "off";
    ``stop_token_ids`` are the ids that can end a completion before its budget."""
    return {
        "rows": rows, "max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": float(top_p),
        "top_k": top_k or None, "stop_token_ids": sorted(int(i) for i in stop_token_ids),
        "dtype": str(dtype).removeprefix("torch."),
    }


def generation_report(spec: dict[str, Any], rows: list[list[int]], durations: Sequence[float],
                      completion_lengths: Sequence[Sequence[int]], settings: dict[str, Any]) -> dict[str, Any]:
    """A child's report: the timed calls' seconds (those after ``spec["warmup"]``), per call
    the prompts it sent (:func:`common.step_record`: digest and sorted lengths), its completion
    lengths and each row's prompt + completion length (row order), and the settings with the
    weights digest. No losses. Dense form: fails unless every completion used the budget."""
    w = spec["warmup"]
    assert len(durations) == len(completion_lengths) == w + spec["steps"], (len(durations), len(completion_lengths))
    if spec["form"] == "dense":
        short = [n for call in completion_lengths for n in call if n != spec["max_new_tokens"]]
        assert not short, f"dense form: {len(short)} completions are not {spec['max_new_tokens']} tokens, e.g. {short[:5]}"
    return {
        "step_times_s": list(durations[w:]),
        "losses": [],
        "steps": [{**step_record(rows, 0), "completion_lengths": list(call),
                   "total_lengths": [len(r) + n for r, n in zip(rows, call, strict=True)]} for call in completion_lengths],
        "settings": {**settings, "weights": weights_digest(spec["model_dir"]), "form": spec["form"]},
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------- sides


def posttrain_generation(spec: dict[str, Any], backend: str) -> dict[str, Any]:
    """``warmup + steps`` calls of posttrain's ``backend`` generation, built through the plugin
    registry from a run config as a GRPO run builds it; each call is prepare, generate, finish."""
    from posttrain.backend.generation_group import build_request
    from posttrain.batch import Batch
    from posttrain.config import config_from_dict
    from posttrain.distributed.cluster import VirtualCluster, init_ray
    from posttrain.plugins import plugin_host

    rows, threads = read_rows(spec), spec["threads"]
    config = config_from_dict({
        "seed": spec["seed"],
        "run_dir": str(Path(spec["workdir"]) / f"posttrain_{backend}_{time.time_ns()}"),
        "cluster": {"num_cpus": threads},
        "policy": {"model": spec["model_dir"], "max_total_sequence_length": spec["max_len"] + spec["max_new_tokens"]},
        "generation": {
            "backend": backend, "dtype": "float32", "max_new_tokens": spec["max_new_tokens"], "temperature": 1.0,
            "ignore_eos": spec["form"] == "dense", "resources": {"cpus": threads},
            "hf": {"max_batch_size": len(rows)},  # every row in one decode batch, as vLLM schedules them
        },
    }, source="benchmark")
    init_ray(config.cluster)
    cluster = VirtualCluster(config.cluster)
    generation = plugin_host().generation_backends[backend](config, cluster)
    width = max(len(r) for r in rows)
    batch = Batch(input_ids=torch.tensor([r + [0] * (width - len(r)) for r in rows]),
                  input_lengths=torch.tensor([len(r) for r in rows]))
    durations, lengths = [], []
    try:
        for _ in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            generation.prepare_for_generation()
            out = generation.generate(batch)
            generation.finish_generation()
            durations.append(time.perf_counter() - start)
            lengths.append(out["generation_lengths"].tolist())
        request = build_request(batch, generation.config.generation, seeds=[0] * len(rows), context_length=generation.context_length,
                                context_key=generation.context_key, eos_token_ids=generation.tokens.eos_token_ids, greedy=False)
    finally:
        generation.shutdown()
        cluster.shutdown()
    settings = sampling_settings(rows=len(request), max_new_tokens=max(request.max_new_tokens), temperature=request.temperature,
                                 top_p=request.top_p, top_k=request.top_k, stop_token_ids=request.stop_token_ids,
                                 dtype=config.generation.dtype)
    return generation_report(spec, rows, durations, lengths, settings)


def zero_reward(completions: list[Any], **_: Any) -> list[float]:
    """A reward function for constructing the TRL trainer (generation never calls it)."""
    return [0.0] * len(completions)


def trl_generation(spec: dict[str, Any]) -> dict[str, Any]:
    """``warmup + steps`` calls of ``GRPOTrainer._generate_single_turn`` (TRL's default
    ``model.generate`` path, the method its training step calls) on the same rows; the
    trainer is built with TRL's defaults plus what the workload fixes (CPU, float32,
    8 generations, the completion budget; dense: ``min_new_tokens`` = the budget)."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows, budget = read_rows(spec), spec["max_new_tokens"]
    args = trl.GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / f"trl_generation_{time.time_ns()}"), report_to=[], use_cpu=True,
        bf16=False, per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS, max_completion_length=budget,
        temperature=1.0, seed=spec["seed"], disable_tqdm=True,
        generation_kwargs={"min_new_tokens": budget} if spec["form"] == "dense" else None,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=zero_reward, args=args, processing_class=AutoTokenizer.from_pretrained(
        spec["model_dir"]), train_dataset=Dataset.from_list([{"prompt": "a"}]))
    durations, lengths = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        completions, _ = trainer._generate_single_turn(rows, None, {}, GENERATIONS)
        durations.append(time.perf_counter() - start)
        lengths.append([len(c) for c in completions])
    gc = trainer.generation_config
    forced = (gc.min_new_tokens or 0) >= gc.max_new_tokens
    settings = sampling_settings(rows=len(rows), max_new_tokens=gc.max_new_tokens, temperature=gc.temperature,
                                 top_p=gc.top_p, top_k=gc.top_k, stop_token_ids=[] if forced else trainer.eos_token_ids,
                                 dtype=next(trainer.model.parameters()).dtype)
    assert gc.do_sample and (gc.repetition_penalty or 1.0) == 1.0 and not gc.min_p, "TRL would sample differently"
    return generation_report(spec, rows, durations, lengths, settings)


# ---------------------------------------------------------------------- summary


def summarize_generation(workload: Workload, spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
                         hf_config: Any, rate: float, rates: list[float], load: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Per side, over every timed call of every repetition: call seconds (median, min, max),
    generated tokens/s (mean generated tokens per call / median seconds), the floor of the
    side's own calls (mean; a forward over prompt + completion tokens / ``rate``), the
    median of time / floor per call, completion lengths, peak memory, time / baseline."""
    w = spec["warmup"]
    rows = {}
    for side, reps in runs.items():
        times, floors, generated, lengths = [], [], [], []
        for r in reps:
            for t, call in zip(r["step_times_s"], r["steps"][w:], strict=True):
                times.append(t)
                floors.append(forward_flops(hf_config, call["total_lengths"]) / rate)
                generated.append(sum(call["completion_lengths"]))
                lengths += call["completion_lengths"]
        median = statistics.median(times)
        rows[side] = {
            "call_s_median": median, "call_s_min": min(times), "call_s_max": max(times),
            "generated_tokens_per_call": statistics.mean(generated), "tokens_per_s": statistics.mean(generated) / median,
            "floor_s": statistics.mean(floors), "time_over_floor": statistics.median(t / f for t, f in zip(times, floors, strict=True)),
            "lengths": length_stats(lengths, spec["max_new_tokens"]), "reps": len(reps), "threads": reps[0]["threads"],
            "peak_rss_mb": max(r.get("peak_rss_mb", float("nan")) for r in reps),
            "infra_rss_mb": max(r.get("infra_rss_mb", float("nan")) for r in reps),
        }
    base = rows[workload.baseline]["call_s_median"]
    for row in rows.values():
        row["vs_baseline"] = row["call_s_median"] / base
    first = next(iter(runs.values()))[0]
    prompt_lengths = first["steps"][0]["lengths"]
    return {
        "workload": workload.name, "model": spec["model"], "parameters": _parameters(hf_config), "form": spec["form"],
        "rows": len(prompt_lengths), "prompt_tokens": sum(prompt_lengths), "max_new_tokens": spec["max_new_tokens"],
        "flops_rule": workload.flops_rule, "matmul_gflops": rate / 1e9, "matmul_gflops_samples": [r / 1e9 for r in rates],
        "baseline": workload.baseline, "steps": spec["steps"], "warmup": w, "load_avg_1m": [x[0] for x in load],
        "machine": _machine(), "sides": rows, "settings": first["settings"], "eos_rate": spec.get("eos_rate_measured"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def generation_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table with its context lines."""
    r = result
    loads = r["load_avg_1m"]
    eos = f", EOS rate {r['eos_rate']:.3f} per token" if r.get("eos_rate") else ""
    lines = [
        f"**generation, {r['form']}{eos}**, model `{r['model']}` ({r['parameters'] / 1e6:.1f}M parameters), {r['rows']} rows "
        f"({r['rows'] // GENERATIONS} prompts x {GENERATIONS}, {r['prompt_tokens']} prompt tokens), up to {r['max_new_tokens']} new tokens, "
        f"{r['steps']} timed calls x {next(iter(r['sides'].values()))['reps']} repetitions per side; {r['date']}, {r['machine']}.",
        f"Floor per call: {r['flops_rule']} / {r['matmul_gflops']:.1f} GFLOP/s (float32 torch.mm, median; samples "
        f"{', '.join(f'{x:.0f}' for x in r['matmul_gflops_samples'])}). Load average (1 min) during the run: "
        f"{min(loads):.1f} to {max(loads):.1f}.",
        "",
        f"| side | call s (median) | min | max | generated tokens/s | completion length mean / median / p90 / max | at budget "
        f"| floor s | time / floor | peak RSS MB (+Ray infra) | time / {r['baseline']} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["sides"].items():
        n = s["lengths"]
        lines.append(
            f"| {name} | {s['call_s_median']:.3f} | {s['call_s_min']:.3f} | {s['call_s_max']:.3f} | {s['tokens_per_s']:.0f} "
            f"| {n['mean']:.1f} / {n['median']:.0f} / {n['p90']:.0f} / {n['max']:.0f} | {100 * n['at_budget']:.0f}% "
            f"| {s['floor_s']:.3f} | {s['time_over_floor']:.1f} | {s['peak_rss_mb']:.0f} (+{s['infra_rss_mb']:.0f}) "
            f"| {s['vs_baseline']:.2f} |"
        )
    return "\n".join(lines) + "\n"


WORKLOAD = Workload(
    name="generation",
    script=Path(__file__).resolve(),
    sides={
        "posttrain-vllm": lambda spec: posttrain_generation(spec, "vllm"),
        "posttrain-hf": lambda spec: posttrain_generation(spec, "hf"),
        "trl": trl_generation,
    },
    baseline="posttrain-vllm",
    write_data=write_prompts,
    step_flops=lambda config, lengths: forward_flops(config, lengths),
    rows_per_step=PROMPTS * GENERATIONS,
    flops_rule="a forward pass over every row's prompt + completion tokens",
    options={
        "form": {"choices": ["skewed", "dense"], "default": "skewed",
                 "help": f"skewed: completions end at EOS (rate {EOS_RATE} per token); dense: every completion is --max-new-tokens long"},
        "max_new_tokens": {"type": int, "default": 64, "help": "completion budget in tokens"},
    },
    prepare_model=prepare_model,
    summarize=summarize_generation,
    table=generation_table,
)

if __name__ == "__main__":
    main(WORKLOAD)
