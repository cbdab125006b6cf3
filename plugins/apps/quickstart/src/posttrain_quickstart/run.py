"""``posttrain quickstart``: SFT then GRPO on a tiny model and an addition task, on CPU.

The stages are ordinary runs of the registered ``sft`` and ``grpo`` algorithms on configs
built here; only the sizes differ from a GPU run. The sizes and learning rates below were
tuned so that, on 2 CPU cores, GRPO's gain over the SFT model is large next to the
run-to-run spread (see the README's quickstart section for the measured seeds). Validation accuracy is measured three
times with the same greedy evaluation (:func:`posttrain_eval.evaluate.evaluate`, pass@1 of one
greedy answer per problem): on the freshly initialised model (an ``eval`` run), on the SFT
model (GRPO's step-0 validation) and on the final model (GRPO's last validation).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.backend.adapter_folder import ADAPTER_CONFIG
from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_tiny_model
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_eval.command import default_generation_backend
from posttrain_quickstart.plot import plot_curves
from posttrain_quickstart.requirements import check_requirements
from posttrain_quickstart.task import TaskFiles, write_task

#: The task: a+b with a in 0..99 and b in 0..9 (1000 distinct problems), split three ways:
#: worked examples for SFT, prompts for GRPO, held-out problems for validation.
NUM_SFT, NUM_RL, NUM_VALIDATION = 400, 344, 256
#: SFT stops while the model is still learning (875 steps of 16 examples): it knows the format
#: and part of the skill, so GRPO's sampled answers are right often enough to learn from.
SFT_EPOCHS, SFT_LR = 35, 1.0e-3
#: GRPO: 16 prompts x 8 answers per step; the learning rate decays linearly to 0, which
#: keeps the last steps from undoing the gain.
GRPO_STEPS, GRPO_LR, GRPO_SCHEDULE, GRPO_PROMPTS, GRPO_GENERATIONS = 100, 5.0e-4, "linear", 16, 8


def _base_config(model: Path, run_dir: Path, validation: Path, seed: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "run_dir": str(run_dir),
        "cluster": {"num_cpus": 4},
        "policy": {
            "backend": "dtensor",
            "model": str(model),
            "max_total_sequence_length": 48,
            "resources": {"cpus": 1},
        },
        "generation": {"backend": default_generation_backend(), "max_new_tokens": 6, "temperature": 1.0, "resources": {"cpus": 1}},
        "data": {"validation": str(validation), "shuffle": True},
        "environments": {"math": {"num_workers": 1}},
        "checkpointing": {"save_period": 1000, "keep_top_k": 1},
    }


def _grpo_config(model: Path, run_dir: Path, files: TaskFiles, steps: int, export_dir: Path | None, seed: int) -> dict[str, Any]:
    config = _base_config(model, run_dir, files.validation, seed)
    config["policy"].update(train_global_batch_size=64, train_micro_batch_size=32, logprob_micro_batch_size=64,
                            optimizer={"name": "adamw", "lr": GRPO_LR}, scheduler={"name": GRPO_SCHEDULE})
    config["data"]["train"] = str(files.rl_train)
    config["grpo"] = {
        "num_prompts_per_step": GRPO_PROMPTS,
        "num_generations_per_prompt": GRPO_GENERATIONS,
        "max_num_steps": steps,
        "max_num_epochs": 100,
        "val_period": 10,
        "val_at_start": True,
        "baseline": "leave_one_out",
        "normalize_rewards": True,
        "export_dir": str(export_dir) if export_dir else None,
    }
    return config


def _eval_config(model: Path, run_dir: Path, files: TaskFiles, seed: int) -> dict[str, Any]:
    """Greedy accuracy of ``model`` on the validation problems, as GRPO's validation measures it."""
    config = _base_config(model, run_dir, files.validation, seed)
    config["checkpointing"] = {"enabled": False}
    config["eval"] = {"greedy": True, "num_samples": 1, "k": [1], "samples_file": None}
    return config


def _sft_config(model: Path, run_dir: Path, files: TaskFiles, epochs: int, export_dir: Path, seed: int) -> dict[str, Any]:
    config = _base_config(model, run_dir, files.validation, seed)
    config["policy"].update(train_global_batch_size=16, train_micro_batch_size=16, optimizer={"name": "adamw", "lr": SFT_LR},
                            sequence_packing={"enabled": True, "max_tokens_per_row": 256})
    config["data"].update(train=str(files.sft_train), validation=str(files.sft_validation))
    config["sft"] = {"max_num_epochs": epochs, "val_period": 0, "val_at_end": True, "export_dir": str(export_dir)}
    return config


def run_quickstart(run_dir: str | Path, overrides: list[str], *, seed: int = 0, sft_epochs: int = SFT_EPOCHS,
                   grpo_steps: int = GRPO_STEPS, grpo_overrides: Sequence[str] = (),
                   sft_model: str | Path | None = None, rl_algorithm: str = "grpo",
                   base_model: str | Path | None = None) -> dict[str, float]:
    """Run the three stages under ``run_dir`` and return the three validation accuracies.

    ``seed`` sets the model's initial weights and every random choice of the runs (data
    order, sampling); the task's problems are the same for every seed. ``overrides`` apply to
    every stage, ``grpo_overrides`` (after them) to the GRPO training stage only, e.g.
    ``["policy.lora.enabled=true", "policy.optimizer.lr=2e-3"]`` for GRPO with LoRA after full
    SFT. ``sft_model``: start GRPO from this folder (the ``sft_model`` an earlier run with the
    same seed wrote) instead of building and fine-tuning a model; "before SFT" is then not
    measured. ``rl_algorithm``: the RL stage's algorithm, ``grpo`` or one that reads the
    ``grpo`` section (``ppo``, its critic configured by ``grpo_overrides``). ``base_model``: a
    model folder with the quickstart's character tokenizer to fine-tune instead of the tiny
    Llama the seed builds (e.g. another architecture of :mod:`posttrain.testing.zoo`).
    """
    check_requirements()
    if any(item.split("=", 1)[0].strip() == "seed" for item in overrides):
        raise ConfigError("posttrain quickstart: the override 'seed=...' would change the runs' seed but not the model's "
                          "initial weights; pass --seed N instead (run_quickstart(..., seed=N) from Python)")
    run_dir = Path(run_dir).resolve()
    start = time.monotonic()
    files = write_task(run_dir / "data", num_sft=NUM_SFT, num_rl=NUM_RL, num_validation=NUM_VALIDATION, seed=0)

    def stage(algorithm: str, data: dict[str, Any], extra: Sequence[str] = ()) -> dict[str, Any]:
        config = config_from_dict(data, [*overrides, *extra, f"algorithm={algorithm}"])
        return run_algorithm(config)

    accuracies = {}
    if sft_model is None:
        model = Path(base_model) if base_model else build_tiny_model(run_dir / "base_model", size="quickstart", seed=seed)
        before = stage("eval", _eval_config(model, run_dir / "eval_base", files, seed))
        accuracies["before SFT"] = before["mean_reward"]
        sft_model = run_dir / "sft_model"
        stage("sft", _sft_config(model, run_dir / "sft", files, sft_epochs, sft_model, seed))
    final_model = run_dir / "final_model"
    after_grpo = stage(rl_algorithm, _grpo_config(Path(sft_model), run_dir / "grpo", files, grpo_steps, final_model, seed),
                       grpo_overrides)

    records = read_metrics(run_dir / "grpo" / "metrics.jsonl")
    validation = [r for r in records if r["phase"] == "validation"]
    accuracies.update({"after SFT": validation[0]["accuracy"], "after GRPO": after_grpo["validation/accuracy"]})
    png = plot_curves(run_dir / "curves.png", [r for r in records if r["phase"] == "train"], validation,
                      "reward", "accuracy", "posttrain quickstart: GRPO after SFT on addition")
    print(f"\nposttrain quickstart finished in {time.monotonic() - start:.0f} s ({run_dir}, seed {seed})")
    print(f"validation accuracy (greedy, {NUM_VALIDATION} held-out additions):")
    for name, value in accuracies.items():
        print(f"  {name:<11} {value:.3f}")
    print(f"  GRPO gain   {accuracies['after GRPO'] - accuracies['after SFT']:+.3f}")
    kind = "LoRA adapters (PEFT folder)" if (final_model / ADAPTER_CONFIG).is_file() else "model (Hugging Face folder)"
    print(f"curves: {png}\nfinal {kind}: {final_model}")
    return accuracies
