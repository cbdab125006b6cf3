"""Three-digit sums with and without a calculator: SFT, then GRPO, on the tiny model, on CPU.

    python examples/tool_calculator/train.py [--seed 0] [--without-tool] [--out runs/tool_calculator]

The task is ``a+b=`` with ``a`` and ``b`` in 100..999: more carrying than a 0.6M-parameter
model learns from a few hundred examples. With the tool, the prompt lists the built-in
``calculator`` (the chat template, ``template.jinja``, renders the tools' names) and SFT
demonstrates a call in the Llama-3.1 JSON format, the calculator's reply and the answer
copied from it; GRPO then trains tool-calling episodes in the ``tools`` environment, scored
by ``math``. Without it, SFT demonstrates the answer alone and GRPO trains in ``math``.
Everything else is the same: the model, the problems, the steps and the learning rates.
It prints the greedy accuracy on 200 held-out problems after SFT and after GRPO (validated
every 20 steps), and GRPO's mean sampled reward over its first and last five steps.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The tool, as the model calls it and the prompt lists it.
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 123+456"}},
    "required": ["expression"]}}}
NUM_SFT, NUM_RL, NUM_VALIDATION = 400, 480, 200
SFT_EPOCHS, SFT_LR = 14, 1.0e-3
GRPO_STEPS, GRPO_LR, GRPO_PROMPTS, GRPO_GENERATIONS = 60, 3.0e-4, 16, 8


def call(a: int, b: int) -> str:
    return json.dumps({"name": "calculator", "parameters": {"expression": f"{a}+{b}"}}, separators=(",", ":"))


def write_data(folder: Path, with_tool: bool, seed: int = 0) -> dict[str, Path]:
    """SFT demonstrations, GRPO prompts and validation prompts, disjoint problems."""
    rng = random.Random(seed)
    problems = rng.sample([(a, b) for a in range(100, 1000) for b in range(100, 1000)], NUM_SFT + NUM_RL + NUM_VALIDATION)
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / f"{name}.jsonl" for name in ("sft", "rl", "validation")}
    task = "tools" if with_tool else "math"
    with files["sft"].open("w") as f:
        for a, b in problems[:NUM_SFT]:
            question = {"role": "user", "content": f"{a}+{b}="}
            if with_tool:
                turns = [question, {"role": "assistant", "content": call(a, b)}, {"role": "tool", "content": str(a + b)},
                         {"role": "assistant", "content": str(a + b)}]
                f.write(json.dumps({"messages": turns, "tools": [CALCULATOR]}) + "\n")
            else:
                f.write(json.dumps({"messages": [question, {"role": "assistant", "content": str(a + b)}]}) + "\n")
    for name, chunk in (("rl", problems[NUM_SFT:NUM_SFT + NUM_RL]), ("validation", problems[NUM_SFT + NUM_RL:])):
        with files[name].open("w") as f:
            for a, b in chunk:
                f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
                                    "task": task}) + "\n")
    return files


def base_config(model: Path, run_dir: Path, files: dict[str, Path], seed: int, with_tool: bool) -> dict[str, Any]:
    from posttrain_eval.command import default_generation_backend  # vLLM where installed, hf otherwise

    return {
        "seed": seed, "run_dir": str(run_dir), "cluster": {"num_cpus": 4},
        "policy": {"backend": "dtensor", "model": str(model), "max_total_sequence_length": 256, "resources": {"cpus": 1}},
        "generation": {"backend": default_generation_backend(), "max_new_tokens": 64, "temperature": 1.0, "resources": {"cpus": 1}},
        "data": {"validation": str(files["validation"]), "shuffle": True, "chat_template": str(HERE / "template.jinja")},
        "environments": (
            {"tools": {"reward": "math", "reward_options": {"num_workers": 1}, "tools": ["calculator"],
                       "format": "llama3_json", "max_tool_calls": 1, "num_workers": 1}}
            if with_tool else {"math": {"num_workers": 1}}
        ),
        "checkpointing": {"save_period": 1000, "keep_top_k": 1},
    }


def sft_config(model: Path, run_dir: Path, files: dict[str, Path], seed: int, with_tool: bool, epochs: int,
               export: Path) -> dict[str, Any]:
    config = base_config(model, run_dir, files, seed, with_tool)
    config["policy"].update(train_global_batch_size=16, train_micro_batch_size=16, optimizer={"name": "adamw", "lr": SFT_LR},
                            sequence_packing={"enabled": True, "max_tokens_per_row": 2048})
    config["data"].update(train=str(files["sft"]), validation=None)
    config["sft"] = {"max_num_epochs": epochs, "val_period": 0, "val_at_end": False, "export_dir": str(export)}
    return config


def grpo_config(model: Path, run_dir: Path, files: dict[str, Path], seed: int, with_tool: bool, steps: int) -> dict[str, Any]:
    config = base_config(model, run_dir, files, seed, with_tool)
    config["policy"].update(train_global_batch_size=GRPO_PROMPTS * GRPO_GENERATIONS, train_micro_batch_size=64,
                            logprob_micro_batch_size=128, optimizer={"name": "adamw", "lr": GRPO_LR},
                            scheduler={"name": "linear"})
    config["data"]["train"] = str(files["rl"])
    config["grpo"] = {"num_prompts_per_step": GRPO_PROMPTS, "num_generations_per_prompt": GRPO_GENERATIONS,
                      "max_num_steps": steps, "max_num_epochs": 100, "val_period": 20, "val_at_start": True,
                      "max_rollout_turns": 2 if with_tool else 1}
    return config


def train(out: Path, *, seed: int, with_tool: bool, sft_epochs: int = SFT_EPOCHS, grpo_steps: int = GRPO_STEPS,
          overrides: list[str] = ()) -> dict[str, float]:
    """SFT then GRPO under ``out``; the greedy validation accuracy after each and GRPO's rewards."""
    from posttrain.config import config_from_dict
    from posttrain.models.tiny import build_tiny_model
    from posttrain.run.context import run_algorithm
    from posttrain.run.metrics import read_metrics

    model = build_tiny_model(out / "base_model", size="quickstart", seed=seed)
    files = write_data(out / "data", with_tool)
    run_algorithm(config_from_dict(sft_config(model, out / "sft", files, seed, with_tool, sft_epochs, out / "sft_model"),
                                   [*overrides, "algorithm=sft"]))
    result = run_algorithm(config_from_dict(grpo_config(out / "sft_model", out / "grpo", files, seed, with_tool, grpo_steps),
                                            [*overrides, "algorithm=grpo"]))
    validation = read_metrics(out / "grpo" / "metrics.jsonl", "validation")
    train_records = read_metrics(out / "grpo" / "metrics.jsonl", "train")
    return {"after SFT": validation[0]["accuracy"], "after GRPO": result["validation/accuracy"],
            "first rewards": sum(r["reward"] for r in train_records[:5]) / 5,
            "last rewards": sum(r["reward"] for r in train_records[-5:]) / 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-tool", action="store_true")
    parser.add_argument("--out", default="runs/tool_calculator")
    parser.add_argument("overrides", nargs="*", help="config overrides for both stages, e.g. generation.backend=hf")
    args = parser.parse_args()
    with_tool = not args.without_tool
    out = Path(args.out).resolve() / f"{'tool' if with_tool else 'no_tool'}_seed{args.seed}"
    began = time.monotonic()
    result = train(out, seed=args.seed, with_tool=with_tool, overrides=args.overrides)
    print(f"\n{'with' if with_tool else 'without'} the calculator, seed {args.seed}, {time.monotonic() - began:.0f} s ({out})")
    for name, value in result.items():
        print(f"  {name:<13} {value:.3f}")


if __name__ == "__main__":
    main()
