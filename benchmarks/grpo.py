"""GRPO, posttrain vs TRL's GRPOTrainer: 16 prompts x 8 generations, up to 64 new tokens, float32.

    python benchmarks/grpo.py --model small --form skewed --reps 2 --steps 3 --out runs/bench_grpo

Sides (alternating, each in its own process):

- ``posttrain``: :func:`posttrain.run.context.run_algorithm` on a GRPO config as a user writes it:
  dtensor policy (one worker, sequence packing in rows of :func:`packed_row_tokens`), vLLM
  generation colocated, its own Ray
  cluster, the ``bench_reward`` environment (:mod:`grpo_reward`) as an installed plugin.
  Step times are the ``time`` stamps of consecutive ``metrics.jsonl`` train records; the
  per-stage ``timing/<stage>`` metrics of every timed step are kept.
- ``posttrain-worker``: ``posttrain`` with the policy in a worker process of its own
  (``policy.in_driver: false``), the default of earlier releases; ``posttrain`` runs it in the
  driver's process (one CPU worker, ``policy.in_driver`` left null).
- ``posttrain-hf``: the same run with the ``hf`` generation backend (posttrain's own batched
  decode, all 128 rows in one batch) instead of vLLM, which on CPU pays a fixed cost per
  decoding step.
- ``posttrain-inside``: ``posttrain-hf`` with the engine inside the policy's worker
  (``generation.in_policy_workers``): no engine process, the refit in memory.
- ``posttrain-exact``: ``posttrain-inside`` with exact logprobs (``generation.exact_logprobs``):
  the engine reports each sampled token's logprob with the trainer's own arithmetic, so the
  loss takes them (``rollout_correction: bypass``) and no previous-policy pass runs. Its cost
  is in the generation stage.
- ``posttrain-inside-ac``: ``posttrain-inside`` with activation checkpointing (each decoder
  layer recomputed in the backward pass), as ``trl-default`` has gradient checkpointing:
  the side to compare peak memory with it.
- ``posttrain-inside-2u``, ``posttrain-exact-2u``: the same two with two optimizer updates
  per step (each on half of the step's samples). Off policy after the first update, the
  default then runs a previous-policy pass over the step's samples (the ``logprobs``
  stage), which exact mode skips: compare these two for the time it saves.
- ``posttrain-apart``: ``posttrain`` with the engine on its own worker
  (``generation.colocated: false``), synchronous: generation and training take turns.
- ``posttrain-apart-passive``: ``posttrain-apart`` with ``OMP_WAIT_POLICY=PASSIVE`` in the
  policy's and the engine's environment (OpenMP threads sleep when idle instead of spinning).
- ``posttrain-async``: ``posttrain-apart-passive`` made asynchronous
  (``grpo.asynchronous.max_staleness_steps: 1``): the next step's rollout runs while a step
  trains. Compare it with ``posttrain-apart`` (same placement, same processes). The policy
  and the engine share all the cores at the same time; with passive waiting a process's
  idle threads leave the cores to the other's.
- ``posttrain-async-split``: asynchronous, each of the two with half of the cores (the policy
  ``OMP_NUM_THREADS``, the engine ``VLLM_CPU_OMP_THREADS_BIND``), default OpenMP waiting.
- ``posttrain-async-spin``: asynchronous, all the cores each, default OpenMP waiting: the
  threads of two processes spin against each other on the same cores.
- ``trl-default``: ``trl.GRPOTrainer`` with TRL 1.16's defaults for everything that is not a
  must-match setting (transformers ``generate``, gradient checkpointing, ``adamw_torch_fused``).
- ``trl-best``: TRL with the CPU options that do not change the math (see :data:`TRL_BEST`).

``--latency S`` and ``--turns N`` make rollouts wait rather than compute, as agentic, code and
remote-reward environments do: every environment call waits ``S`` seconds and an episode lasts
``N`` assistant turns (:mod:`grpo_reward`); TRL's side does not take them. E.g. the
asynchronous comparison: ``--sides posttrain-apart,posttrain-async --latency 1.5 --turns 3``.
``--prompts N`` (default 16, the TRL comparison's) sets the prompts per step, 8 generations
each: fewer make the training stage shorter against a fixed environment latency.
``--max-new-tokens N`` (default 64) sets the budget of every completion (of every assistant
turn with ``--turns``) on every side: an agent's turns are often short tool calls.

``--activation-checkpointing``: posttrain's sides recompute each decoder layer in the
backward pass, as TRL's defaults do (``gradient_checkpointing``): the setting to compare peak
memory with ``trl-default`` (without it posttrain keeps every layer's activations of the
step's 128 samples, as ``trl-best`` does).

``--form skewed``: completions stop at EOS; the benchmark's model gets a context-independent
EOS rate of :data:`EOS_RATE` per token (:func:`common.set_eos_rate`: mean length about 19,
about 4% reach 64). ``--form dense``: every completion is exactly 64 tokens (posttrain
``generation.ignore_eos``; TRL ``min_new_tokens`` / vLLM ``min_tokens`` = 64), asserted.

Checked on every run (:func:`common.check_settings`): weights digest, the prompts of every
step in order (digest of their token ids, their token count, the sample count), generations
per prompt, max new tokens, sampling (temperature 1, top_p 1, no top_k), reward function,
AdamW (lr, betas, eps, weight decay, constant schedule), clipping 1.0, one optimizer step
per GRPO step, PPO clip 0.2/0.2, token-level loss normalisation, KL beta 0, advantages
(r - group mean) / group std. The sides sample different tokens, so per step each reports
its own completion lengths and the floor counts each side's own tokens.
Floor per step: 4 x :func:`common.forward_flops` over every sequence's prompt + completion
(generation 1x, training 3x). No previous-policy logprob pass is counted: with one optimizer
step per GRPO step the policy is on policy, and neither side runs one (posttrain since commit
7cec9ff, TRL with ``num_iterations=1`` and ``steps_per_generation=1`` without vLLM); both use
the training pass's own logprobs, detached. Counting one would raise the floor by a quarter.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from common import Workload, child_result, forward_flops, length_stats, main, random_text, set_eos_rate  # noqa: E402

#: Prompts per step (``--prompts`` sets another count; 16 is the TRL comparison's), generations
#: per prompt, new tokens per completion (per assistant turn with ``--turns``; ``--max-new-tokens``
#: sets another budget).
PROMPTS, GENERATIONS, MAX_NEW_TOKENS = 16, 8, 64
#: Per-token EOS probability of the skewed form's model: geometric lengths, mean about 19 tokens
#: within the 64-token budget, about 4% of completions reach it.
EOS_RATE = 0.05
#: Prompt lengths (characters = tokens of the user message) are drawn uniformly from this range.
PROMPT_CHARS = (8, 32)
#: The floor's forward passes per step: generation 1, training 3 (no previous-policy pass: on policy).
FLOOR_PASSES = {"generation": 1, "training": 3}
#: trl-best's options (``--trl-best``), all leaving the math unchanged. ``cpu`` (the default):
#: no gradient checkpointing (it only trades compute for memory). Tried and rejected:
#: ``continuous-batching`` (transformers' continuous-batching generation: 4x slower than
#: trl-default and 12 GB peak memory on the tiny model) and ``vllm`` (colocated vLLM: the
#: engine starts, then TRL's first weight sync fails inside vLLM-CPU, ``load_weights`` after
#: start: ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``; vLLM-CPU
#: repacks the linear weights at load). The ``generation_kwargs`` of the dense form are added.
TRL_BEST: dict[str, dict[str, Any]] = {
    "cpu": {"gradient_checkpointing": False},
    "continuous-batching": {"gradient_checkpointing": False, "use_transformers_continuous_batching": True},
    "vllm": {"gradient_checkpointing": False, "use_vllm": True, "vllm_mode": "colocate",
             "vllm_gpu_memory_utilization": 0.3, "vllm_enable_sleep_mode": False},
}


# ---------------------------------------------------------------------- model and data


def prepare_model(spec: dict[str, Any], model_dir: Path) -> None:
    """Skewed form: give the model its EOS rate (recorded in the spec); dense: unchanged."""
    if spec["form"] == "skewed":
        spec["eos_rate_measured"] = set_eos_rate(model_dir, EOS_RATE, seed=spec["seed"])


def write_prompts(spec: dict[str, Any], path: Path) -> None:
    """``prompts x (warmup + steps)`` one-message chat prompts of random text (rows
    ``{"messages": [{"role": "user", "content": ...}]}``), in the order every side uses them."""
    g = torch.Generator().manual_seed(spec["seed"])
    with path.open("w") as f:
        for _ in range(spec["prompts"] * (spec["warmup"] + spec["steps"])):
            chars = int(torch.randint(PROMPT_CHARS[0], PROMPT_CHARS[1] + 1, (1,), generator=g))
            f.write(json.dumps({"messages": [{"role": "user", "content": random_text(chars, g)}]}) + "\n")


# ---------------------------------------------------------------------- what a side reports per step


def grpo_step_record(prompt_ids: list[list[int]], completion_lengths: list[int]) -> dict[str, Any]:
    """One GRPO step's record from its rows in generation order: the prompts'
    digest (ordered; each prompt appears ``GENERATIONS`` times in a row), prompt and
    completion token counts, the sorted sequence lengths (prompt + completion, what the
    floor counts) and the sorted completion lengths."""
    if len(prompt_ids) != len(completion_lengths):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_lengths)} completion lengths")
    digest = hashlib.sha256(json.dumps([[int(t) for t in p] for p in prompt_ids]).encode()).hexdigest()[:16]
    return {
        "prompt_digest": digest, "samples": len(prompt_ids),
        "prompt_tokens": sum(len(p) for p in prompt_ids), "completion_tokens": int(sum(completion_lengths)),
        "lengths": sorted(len(p) + int(c) for p, c in zip(prompt_ids, completion_lengths, strict=True)),
        "completion_lengths": sorted(int(c) for c in completion_lengths),
    }


def check_completions(steps: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    """Dense form: every completion must be exactly the budget, ``spec["max_new_tokens"]``."""
    if spec["form"] == "dense":
        budget = spec["max_new_tokens"]
        bad = [(k, s["completion_lengths"][0]) for k, s in enumerate(steps, 1) if s["completion_lengths"][0] != budget]
        if bad:
            raise AssertionError(f"dense form: completions shorter than {budget} tokens (step, shortest): {bad}")


def common_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """Settings both sides hold by construction of this module (the rest is read back)."""
    return {"form": spec["form"], "reward": "grpo_reward.vowel_share", "num_prompts": spec["prompts"]}


def samples_per_step(spec: dict[str, Any]) -> int:
    return spec["prompts"] * GENERATIONS


#: glibc's largest mmap threshold on 64-bit Linux: a larger allocation gets fresh pages from the
#: kernel, faulted in and zeroed at every use, instead of memory the heap already holds.
MMAP_THRESHOLD_MAX = 32 * 2**20


def packed_row_tokens(spec: dict[str, Any]) -> int:
    """Tokens per packed row (one row per microbatch) of the posttrain sides: every sample of
    a step in one row, but no more tokens than keep the row's largest activation (the MLP's
    ``tokens x intermediate_size`` float32) under half of :data:`MMAP_THRESHOLD_MAX`, in
    whole ``max_len`` units. On the small model (2560 tokens) that trained a dense step 15%
    and a skewed one 10% faster than one row of every sample."""
    from transformers import AutoConfig

    intermediate = AutoConfig.from_pretrained(spec["model_dir"]).intermediate_size
    under = MMAP_THRESHOLD_MAX // 2 // (4 * intermediate) // spec["max_len"] * spec["max_len"]
    return max(spec["max_len"], min(samples_per_step(spec) * spec["max_len"], under))


# ---------------------------------------------------------------------- posttrain


def posttrain_grpo(spec: dict[str, Any], generation_backend: str = "vllm", *, colocated: bool = True,
                   in_policy_workers: bool = False, max_staleness_steps: int = 0, split_cores: bool = False,
                   passive: bool = False, in_driver: bool | None = None, exact: bool = False,
                   updates: int = 1, checkpointing: bool = False) -> dict[str, Any]:
    """Run ``warmup + steps`` GRPO steps with ``run_algorithm`` (rollouts from the
    ``generation_backend``: ``vllm``, or ``hf`` decoding all 128 rows as one batch; the engine
    ``colocated`` with the policy or on its own worker, or ``in_policy_workers``; asynchronous with
    ``max_staleness_steps`` >= 1; ``split_cores``: the policy's threads on the first half of
    the cores, the vLLM engine's bound to the second half, for a policy and an engine that
    run at the same time; ``passive``: their OpenMP threads sleep when idle,
    ``OMP_WAIT_POLICY=PASSIVE``, instead of spinning; ``in_driver``: ``policy.in_driver``;
    ``exact``: ``generation.exact_logprobs``; ``updates``: optimizer updates per step, each on
    an equal share of the step's samples; ``checkpointing``: activation checkpointing, as
    ``--activation-checkpointing`` gives every side); read back the step ends, losses and stage timings from
    ``metrics.jsonl`` and what every step generated from the reward environment's record."""
    from posttrain.config import config_from_dict
    from posttrain.data import encoder_from_config
    from posttrain.run.context import run_algorithm
    from posttrain.run.metrics import read_metrics
    from posttrain.run.rollout import ChatFormat

    _install_reward_plugin(Path(spec["workdir"]) / "plugin")
    threads, dense, samples = spec["threads"], spec["form"] == "dense", samples_per_step(spec)
    # the colocated policy and engine take turns on all the cores (twice the logical CPUs for Ray);
    # split, each has half of them: OpenMP threads of two processes on the same cores thrash
    policy_threads = threads // 2 if split_cores else threads
    wait = {"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}
    engine_env = {"VLLM_CPU_OMP_THREADS_BIND": f"{threads // 2}-{threads - 1}"} if split_cores else {}
    run_dir = Path(spec["workdir"]) / f"posttrain_grpo_{time.time_ns()}"
    record = run_dir / "rollouts.jsonl"
    config = config_from_dict({
        "algorithm": "grpo", "seed": spec["seed"], "run_dir": str(run_dir),
        "cluster": {"num_cpus": threads if split_cores else 2 * threads},
        "policy": {
            "backend": "dtensor", "model": spec["model_dir"], "dtype": "float32", "num_workers": 1,
            "train_global_batch_size": samples // updates, "train_micro_batch_size": samples // updates,
            "logprob_micro_batch_size": samples,
            "max_total_sequence_length": spec["max_len"], "max_grad_norm": 1.0,
            "sequence_packing": {"enabled": True, "max_tokens_per_row": packed_row_tokens(spec)},
            "optimizer": {"name": "adamw", "lr": spec["lr"]}, "scheduler": {"name": "constant"},
            "resources": {"cpus": policy_threads, "env_vars": {"OMP_NUM_THREADS": str(policy_threads), **wait}},
            "dtensor": {"activation_checkpointing": spec["activation_checkpointing"] or checkpointing}, "in_driver": in_driver,
        },
        "generation": {
            "backend": generation_backend, "max_new_tokens": spec["max_new_tokens"], "temperature": 1.0, "top_p": 1.0,
            "top_k": None, "ignore_eos": dense, "colocated": colocated,
            "in_policy_workers": in_policy_workers, "exact_logprobs": exact,
            "resources": {"cpus": threads - policy_threads if split_cores else threads, "env_vars": {**engine_env, **wait}},
            **({"hf": {"max_batch_size": samples}} if generation_backend == "hf" else {}),
        },
        "data": {"train": spec["data"], "shuffle": False},
        "environments": {"bench_reward": {"record": str(record), "latency_s": spec["latency"], "turns": spec["turns"]}},
        "grpo": {
            "num_prompts_per_step": spec["prompts"], "num_generations_per_prompt": GENERATIONS, "max_rollout_turns": spec["turns"],
            "asynchronous": {"max_staleness_steps": max_staleness_steps},
            "max_num_steps": spec["warmup"] + spec["steps"], "val_period": 0, "baseline": "mean", "normalize_rewards": True,
            "loss": {"ratio_clip_low": 0.2, "ratio_clip_high": 0.2, "token_level_loss": True, "kl_penalty": 0.0},
        },
        "checkpointing": {"enabled": False},
        "logger": {"progress_bar": False, "level": "warning"},
    }, source="benchmark")
    run_algorithm(config)
    records = read_metrics(run_dir / "metrics.jsonl", "train")
    rollouts = [json.loads(line) for line in record.read_text().splitlines()]
    if len(rollouts) != len(records):
        raise RuntimeError(f"{len(records)} GRPO steps but the reward environment scored {len(rollouts)} batches")
    encoder = encoder_from_config(config)
    chat = ChatFormat(encoder.tokenizer, encoder.template)
    steps = []
    for rollout, rec in zip(rollouts, records, strict=True):
        prompt_ids = [chat.prompt_ids([{"role": "user", "content": text}]) for text in rollout["prompts"]]
        steps.append(grpo_step_record(prompt_ids, rollout["completion_lengths"]))
        if steps[-1]["completion_tokens"] != rec["rollout/generated_tokens"]:
            raise RuntimeError(f"the environment saw {steps[-1]['completion_tokens']} completion tokens, "
                               f"the run logged {rec['rollout/generated_tokens']}")
    check_completions(steps, spec)
    p, g, grpo = config.policy, config.generation, config.section("grpo")
    settings = {
        **common_settings(spec),
        "optimizer": p.optimizer.name, "lr": p.optimizer.lr, "betas": list(p.optimizer.betas), "eps": p.optimizer.eps,
        "weight_decay": p.optimizer.weight_decay, "scheduler": p.scheduler.name, "warmup_steps": p.scheduler.warmup_steps,
        "max_grad_norm": p.max_grad_norm, "dtype": p.dtype,
        "optimizer_steps_per_grpo_step": max(1, grpo.samples_per_step // p.train_global_batch_size),
        "generations": grpo.num_generations_per_prompt, "samples_per_step": grpo.samples_per_step,
        "max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
        "forced_length": g.ignore_eos,
        "clip": [grpo.loss.ratio_clip_low, grpo.loss.ratio_clip_high], "kl_beta": grpo.loss.kl_penalty,
        "loss_normalisation": "token" if grpo.loss.token_level_loss else "sequence",
        "advantages": f"(r - group {grpo.baseline}) / group std" if grpo.normalize_rewards else f"r - group {grpo.baseline}",
    }
    report = child_result(spec, [r["time"] for r in records], [r["loss"] for r in records], steps, settings)
    report["stages"] = [{k.removeprefix("timing/"): v for k, v in r.items() if k.startswith("timing/")}
                        for r in records[spec["warmup"]:]]
    report["rewards"] = [statistics.mean(r["rewards"]) for r in rollouts]
    return report


def _install_reward_plugin(folder: Path) -> None:
    """Make :mod:`grpo_reward` an installed ``posttrain`` plugin of this process and of the
    Ray workers it starts (they inherit ``PYTHONPATH``)."""
    from grpo_reward import install_plugin

    paths = [str(install_plugin(folder)), str(BENCHMARKS)]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = paths
    importlib.invalidate_caches()


# ---------------------------------------------------------------------- TRL


def trl_grpo(spec: dict[str, Any], best: bool) -> dict[str, Any]:
    """Run ``warmup + steps`` steps of ``trl.GRPOTrainer`` on CPU in float32, prompts in file
    order, one optimizer step of all the step's completions per generation; TRL's defaults
    or, with ``best``, the :data:`TRL_BEST` options named by ``--trl-best``."""
    import trl
    from datasets import Dataset
    from grpo_reward import BenchRewardEnvironment
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if spec["latency"] or spec["turns"] != 1:
        raise ValueError("--latency and --turns apply to posttrain's sides only; run TRL's sides without them")
    dense = spec["form"] == "dense"
    options = dict(TRL_BEST[spec["trl_best"]]) if best else {}
    if dense:  # EOS suppressed until the budget: exactly max_new_tokens tokens
        options["generation_kwargs"] = {"min_tokens" if options.get("use_vllm") else "min_new_tokens": spec["max_new_tokens"]}
    args = trl.GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / f"trl_grpo_{time.time_ns()}"), report_to=[], use_cpu=True, bf16=False,
        per_device_train_batch_size=samples_per_step(spec), gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=GENERATIONS, max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=spec["warmup"] + spec["steps"],
        beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=spec["seed"], dataloader_pin_memory=False, **options,
    )
    environment = BenchRewardEnvironment()

    def vowel_share(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        logs = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
        return environment.step(logs, [{}] * len(logs)).rewards.tolist()

    step_ends: list[float] = []
    losses: list[float] = []
    steps: list[dict[str, Any]] = []
    rewards: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_ends.append(time.time())

    class Observed(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            prompts = [ids[m.bool()].tolist() for ids, m in zip(out["prompt_ids"], out["prompt_mask"], strict=True)]
            steps.append(grpo_step_record(prompts, out["completion_mask"].sum(1).tolist()))
            rewards.append(float(self._metrics["train"]["reward"][-1]))
            return out

        def training_step(self, model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> torch.Tensor:
            loss = super().training_step(model, inputs, *a, **k)
            losses.append(float(loss))
            return loss

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    rows = [{"prompt": json.loads(line)["messages"]} for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    trainer = Observed(model=model, reward_funcs=[vowel_share], args=args, train_dataset=Dataset.from_list(rows),
                       processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]), callbacks=[StepEnds()])
    trainer.train()
    check_completions(steps, spec)
    group = trainer.optimizer.param_groups[0]
    top_k = args.top_k or None
    settings = {
        **common_settings(spec),
        "optimizer": "adamw" if "adamw" in str(args.optim).lower() else str(args.optim), "lr": group["lr"],
        "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
        "scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)), "warmup_steps": int(args.warmup_steps),
        "max_grad_norm": args.max_grad_norm, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "optimizer_steps_per_grpo_step": args.steps_per_generation * args.num_iterations,
        "generations": args.num_generations, "samples_per_step": args.per_device_train_batch_size * args.gradient_accumulation_steps,
        "max_new_tokens": args.max_completion_length, "temperature": args.temperature, "top_p": args.top_p, "top_k": top_k,
        "forced_length": bool(args.generation_kwargs),
        "clip": [args.epsilon, args.epsilon_high], "kl_beta": args.beta,
        # dapo (and bnpo with one accumulation step): sum of masked token losses / all completion tokens of the step
        "loss_normalisation": "token" if args.loss_type in ("dapo", "bnpo") else args.loss_type,
        "advantages": "(r - group mean) / group std" if args.scale_rewards == "group" else f"scale_rewards={args.scale_rewards}",
    }
    report = child_result(spec, step_ends, losses, steps, settings)
    report["rewards"] = rewards
    report["trl_options"] = {k: v for k, v in options.items()}
    return report


# ---------------------------------------------------------------------- the report


def step_flops(config: Any, lengths: list[int]) -> float:
    return sum(FLOOR_PASSES.values()) * forward_flops(config, lengths)


def side_extras(reports: list[dict[str, Any]], spec: dict[str, Any], config: Any, rate: float) -> dict[str, Any]:
    """Completion lengths over the side's timed steps; for posttrain, the median seconds of
    every ``timing/<stage>`` and the floors of the rollout (generation) and training stages."""
    timed = [s for r in reports for s in r["steps"][spec["warmup"]:]]
    extras: dict[str, Any] = {
        "completions": length_stats([n for s in timed for n in s["completion_lengths"]], spec["max_new_tokens"]),
        "prompt_tokens_per_step": statistics.mean(s["prompt_tokens"] for s in timed),
        "completion_tokens_per_step": statistics.mean(s["completion_tokens"] for s in timed),
        "mean_reward": statistics.mean(x for r in reports for x in r["rewards"]),
    }
    stages = [st for r in reports for st in r.get("stages", [])]
    if stages:
        extras["stage_s_median"] = {name: statistics.median(st[name] for st in stages if name in st) for name in stages[0]}
        one_pass = statistics.mean(forward_flops(config, s["lengths"]) for s in timed) / rate
        extras["stage_floor_s"] = {"rollout": one_pass * FLOOR_PASSES["generation"], "training": one_pass * FLOOR_PASSES["training"]}
    return extras


def extra_table(result: dict[str, Any]) -> str:
    """Completion lengths per side and posttrain's stage times next to their floors."""
    lines = ["", "| side | completion tokens / step | prompt tokens / step | mean | median | p90 | share at budget | floor s | mean reward |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in result["sides"].items():
        c = s["completions"]
        lines.append(f"| {name} | {s['completion_tokens_per_step']:.0f} | {s['prompt_tokens_per_step']:.0f} | {c['mean']:.1f} "
                     f"| {c['median']:.0f} | {c['p90']} | {c['at_budget']:.2f} | {s['floor_s']:.3f} | {s['mean_reward']:.3f} |")
    for name, s in result["sides"].items():
        if "stage_s_median" not in s:
            continue
        lines += ["", f"{name} stages (median s per step; rollout = generation + reward; floors from this side's tokens):", "",
                  "| stage | s | floor s | time / floor |", "|---|---:|---:|---:|"]
        for stage, seconds in s["stage_s_median"].items():
            floor = s["stage_floor_s"].get(stage)
            lines.append(f"| {stage} | {seconds:.3f} | {'' if floor is None else f'{floor:.3f}'} "
                         f"| {'' if floor is None else f'{seconds / floor:.1f}'} |")
    return "\n".join(lines) + "\n"


WORKLOAD = Workload(
    name="grpo",
    script=Path(__file__).resolve(),
    sides={
        "posttrain": posttrain_grpo,
        "trl-default": lambda spec: trl_grpo(spec, best=False),
        "posttrain-worker": lambda spec: posttrain_grpo(spec, in_driver=False),
        "posttrain-hf": lambda spec: posttrain_grpo(spec, "hf"),
        "posttrain-inside": lambda spec: posttrain_grpo(spec, "hf", in_policy_workers=True),
        "posttrain-exact": lambda spec: posttrain_grpo(spec, "hf", in_policy_workers=True, exact=True),
        "posttrain-inside-2u": lambda spec: posttrain_grpo(spec, "hf", in_policy_workers=True, updates=2),
        "posttrain-inside-ac": lambda spec: posttrain_grpo(spec, "hf", in_policy_workers=True, checkpointing=True),
        "posttrain-exact-2u": lambda spec: posttrain_grpo(spec, "hf", in_policy_workers=True, exact=True, updates=2),
        "trl-best": lambda spec: trl_grpo(spec, best=True),
        "posttrain-apart": lambda spec: posttrain_grpo(spec, colocated=False),
        "posttrain-apart-passive": lambda spec: posttrain_grpo(spec, colocated=False, passive=True),
        "posttrain-async": lambda spec: posttrain_grpo(spec, colocated=False, max_staleness_steps=1, passive=True),
        "posttrain-async-split": lambda spec: posttrain_grpo(spec, colocated=False, max_staleness_steps=1, split_cores=True),
        "posttrain-async-spin": lambda spec: posttrain_grpo(spec, colocated=False, max_staleness_steps=1),
    },
    baseline="posttrain",
    write_data=write_prompts,
    step_flops=step_flops,
    rows_per_step=samples_per_step,
    flops_rule="4 x forward over every sequence's prompt + completion tokens: generation 1x, training 3x "
               "(on policy: no previous-policy pass)",
    options={"form": {"choices": ("skewed", "dense"), "default": "skewed",
                      "help": f"skewed: completions stop at EOS (rate {EOS_RATE} per token); dense: all take the whole budget"},
             "max_new_tokens": {"type": int, "default": MAX_NEW_TOKENS,
                                "help": "new tokens per completion (per assistant turn with --turns), every side"},
             "trl_best": {"choices": tuple(TRL_BEST), "default": "cpu", "help": "trl-best's options (grpo.TRL_BEST)"},
             "prompts": {"type": int, "default": PROMPTS, "help": f"prompts per step ({GENERATIONS} generations each)"},
             "latency": {"type": float, "default": 0.0, "help": "seconds every environment call waits (posttrain sides)"},
             "turns": {"type": int, "default": 1, "help": "assistant turns per episode (posttrain sides)"},
             "activation_checkpointing": {"action": "store_true",
                                          "help": "posttrain sides recompute each decoder layer in the backward pass "
                                                  "(policy.dtensor.activation_checkpointing), as trl-default does"}},
    step_fields=("prompt_digest", "prompt_tokens", "samples"),
    loss_rtol=None,
    prepare_model=prepare_model,
    side_extras=side_extras,
    extra_table=extra_table,
    # At the harness's 1e-5 the small model learned within two steps to stop later (mean
    # completion 19 -> 33 -> 39 tokens, on both sides): the reward favours non-empty answers.
    defaults={"lr": 1e-6},
)

if __name__ == "__main__":
    main(WORKLOAD)
