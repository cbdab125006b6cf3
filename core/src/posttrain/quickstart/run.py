"""``posttrain quickstart``: SFT then GRPO on a tiny model and an addition task, on CPU.

The stages are ordinary runs of the registered ``sft`` and ``grpo`` algorithms on configs
built here; only the sizes differ from a GPU run. Validation accuracy is measured three
times with the same greedy validation of the GRPO algorithm: on the freshly initialised
model (a GRPO run with ``max_num_steps: 0``), on the SFT model (GRPO's step-0 validation)
and on the final model.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from posttrain.config import config_from_dict
from posttrain.metrics import read_metrics
from posttrain.plugins import plugin_host
from posttrain.quickstart.plot import plot_curves
from posttrain.quickstart.task import write_task
from posttrain.run import run_algorithm
from posttrain.tiny import build_tiny_model


def _generation_backend() -> str:
    """vLLM where it is installed, the transformers backend otherwise."""
    return "vllm" if "vllm" in plugin_host().generation_backends and importlib.util.find_spec("vllm") else "hf"


def _base_config(model: Path, run_dir: Path, validation: Path) -> dict[str, Any]:
    return {
        "seed": 0,
        "run_dir": str(run_dir),
        "cluster": {"num_cpus": 4},
        "policy": {
            "backend": "dtensor",
            "model": str(model),
            "max_total_sequence_length": 48,
            "resources": {"cpus": 1},
        },
        "generation": {"backend": _generation_backend(), "max_new_tokens": 6, "temperature": 1.0, "resources": {"cpus": 1}},
        "data": {"validation": str(validation), "shuffle": True},
        "environments": {"math": {"num_workers": 1}},
        "checkpointing": {"save_period": 1000, "keep_top_k": 1},
    }


def _grpo_config(model: Path, run_dir: Path, files: Any, steps: int, export_dir: Path | None) -> dict[str, Any]:
    config = _base_config(model, run_dir, files.validation)
    config["policy"].update(train_global_batch_size=64, train_micro_batch_size=32, logprob_micro_batch_size=64,
                            optimizer={"name": "adamw", "lr": 1.0e-3})
    config["data"]["train"] = str(files.rl_train)
    config["grpo"] = {
        "num_prompts_per_step": 8,
        "num_generations_per_prompt": 8,
        "max_num_steps": steps,
        "max_num_epochs": 100,
        "val_period": 5,
        "val_at_start": True,
        "baseline": "leave_one_out",
        "normalize_rewards": True,
        "export_dir": str(export_dir) if export_dir else None,
    }
    return config


def _sft_config(model: Path, run_dir: Path, files: Any, epochs: int, export_dir: Path) -> dict[str, Any]:
    config = _base_config(model, run_dir, files.validation)
    config["policy"].update(train_global_batch_size=16, train_micro_batch_size=16, optimizer={"name": "adamw", "lr": 3.0e-3},
                            sequence_packing={"enabled": True, "max_tokens_per_row": 256})
    config["data"].update(train=str(files.sft_train), validation=str(files.sft_validation))
    config["sft"] = {"max_num_epochs": epochs, "val_period": 0, "val_at_end": True, "export_dir": str(export_dir)}
    return config


def run_quickstart(run_dir: str | Path, overrides: list[str], *, sft_epochs: int = 30, grpo_steps: int = 30) -> dict[str, float]:
    """Run the three stages under ``run_dir`` and return the three validation accuracies."""
    run_dir = Path(run_dir).resolve()
    start = time.monotonic()
    model = build_tiny_model(run_dir / "base_model", size="quickstart", seed=0)
    files = write_task(run_dir / "data", num_sft=160, num_rl=160, num_validation=64, max_operand=19, seed=0)

    def stage(algorithm: str, data: dict[str, Any]) -> dict[str, Any]:
        config = config_from_dict(data, [*overrides, f"algorithm={algorithm}"])
        return run_algorithm(config)

    before = stage("grpo", _grpo_config(model, run_dir / "eval_base", files, 0, None))
    stage("sft", _sft_config(model, run_dir / "sft", files, sft_epochs, run_dir / "sft_model"))
    final_model = run_dir / "final_model"
    after_grpo = stage("grpo", _grpo_config(run_dir / "sft_model", run_dir / "grpo", files, grpo_steps, final_model))

    records = read_metrics(run_dir / "grpo" / "metrics.jsonl")
    validation = [r for r in records if r["phase"] == "validation"]
    accuracies = {
        "before SFT": before["validation/accuracy"],
        "after SFT": validation[0]["accuracy"],
        "after GRPO": after_grpo["validation/accuracy"],
    }
    png = plot_curves(run_dir / "curves.png", [r for r in records if r["phase"] == "train"], validation,
                      "reward", "accuracy", "posttrain quickstart: GRPO after SFT on addition")
    print(f"\nposttrain quickstart finished in {time.monotonic() - start:.0f} s ({run_dir})")
    print("validation accuracy (greedy, 64 held-out additions):")
    for name, value in accuracies.items():
        print(f"  {name:<11} {value:.3f}")
    print(f"curves: {png}\nfinal model (Hugging Face folder): {final_model}")
    return accuracies
