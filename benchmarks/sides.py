"""The two frameworks' child entry points, written once for SFT and DPO.

``posttrain_side`` runs the algorithm the way a user does (:func:`posttrain.run.context.run_algorithm`
on a config: dtensor backend, one worker, the example data path) and reads the step ends
from ``metrics.jsonl``; what each step trained on is read back through the loop's own data
loader. ``trl_side`` runs TRL's trainer (``trainer.train()``) with a callback that stamps
each optimizer step's end and a ``training_step`` that records the collated batch. Both
read the settings they report from the objects they actually ran with.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
from common import child_result, rows_of, step_record


def posttrain_side(spec: dict[str, Any], algorithm: str, section: dict[str, Any], packing: bool) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of ``algorithm`` on ``spec["data"]``; sequence packing
    (one packed row per step) or padded microbatches of the whole step."""
    from posttrain.config import config_from_dict
    from posttrain.data import dataloader_from_config, dataset_from_config, encoder_from_config
    from posttrain.plugins import plugin_host
    from posttrain.run.context import run_algorithm
    from posttrain.run.metrics import read_metrics

    rows, threads = spec["rows_per_step"], spec["threads"]
    run_dir = Path(spec["workdir"]) / f"posttrain_{algorithm}_{time.time_ns()}"
    config = config_from_dict({
        "algorithm": algorithm,
        "seed": spec["seed"],
        "run_dir": str(run_dir),
        "cluster": {"num_cpus": threads},
        "policy": {
            "backend": "dtensor", "model": spec["model_dir"], "dtype": "float32", "num_workers": 1,
            "train_global_batch_size": rows, "train_micro_batch_size": rows, "logprob_micro_batch_size": rows,
            "max_total_sequence_length": spec["max_len"],
            "sequence_packing": {"enabled": packing, "max_tokens_per_row": rows * spec["max_len"]},
            "optimizer": {"name": "adamw", "lr": spec["lr"]}, "scheduler": {"name": "constant"},
            "resources": {"cpus": threads, "env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        "data": {"train": spec["data"], "shuffle": False, "max_length": spec["max_len"]},
        algorithm: {**section, "max_num_steps": spec["warmup"] + spec["steps"], "val_period": 0, "val_at_end": False},
        "checkpointing": {"enabled": False},
        "logger": {"progress_bar": False, "level": "warning"},
    }, source="benchmark")
    run_algorithm(config)
    records = read_metrics(run_dir / "metrics.jsonl", "train")

    plugin = plugin_host().algorithms[algorithm]()
    dataset = dataset_from_config(config, "train", plugin.data_kind, encoder_from_config(config))
    loader = dataloader_from_config(config, dataset, rows // plugin.rows_per_example)
    steps = []
    for batch, record in zip(itertools.islice(loader, len(records)), records, strict=True):
        seqs = [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["input_lengths"], strict=True)]
        steps.append(step_record(seqs, int(batch["token_mask"].sum())))
        assert sum(len(s) for s in seqs) == record["total_tokens"], "the loader and the run disagree on the tokens"
    p = config.policy
    settings = {
        "optimizer": p.optimizer.name, "lr": p.optimizer.lr, "betas": list(p.optimizer.betas), "eps": p.optimizer.eps,
        "weight_decay": p.optimizer.weight_decay, "scheduler": p.scheduler.name, "warmup_steps": p.scheduler.warmup_steps,
        "max_grad_norm": p.max_grad_norm, "rows_per_step": p.train_global_batch_size,
        "dtype": p.dtype, **section_settings(config.section(algorithm)),
    }
    return child_result(spec, [r["time"] for r in records], [r["loss"] for r in records], steps, settings)


def section_settings(options: Any) -> dict[str, Any]:
    """The loss options both frameworks must share, from posttrain's ``sft`` / ``dpo`` section."""
    if hasattr(options, "beta"):
        return {"loss": f"dpo-{options.loss_type}", "beta": options.beta}
    return {"loss": options.loss}


def trl_side(spec: dict[str, Any], kind: str, best: bool) -> dict[str, Any]:
    """Train ``warmup + steps`` steps with TRL's ``SFTTrainer`` or ``DPOTrainer`` on CPU in
    float32: TRL's defaults (gradient checkpointing on, padded batches) or, with ``best``,
    gradient checkpointing off and ``padding_free=True``. Samples in file order, one
    optimizer step per ``rows_per_step`` rows, constant learning rate."""
    import trl
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    per_device = spec["rows_per_step"] if kind == "sft" else spec["rows_per_step"] // 2
    common = dict(
        output_dir=str(Path(spec["workdir"]) / f"trl_{kind}_{time.time_ns()}"), max_length=None, report_to=[],
        use_cpu=True, bf16=False, per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
        learning_rate=spec["lr"], lr_scheduler_type="constant", max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1, save_strategy="no", disable_tqdm=True, seed=spec["seed"], dataloader_pin_memory=False,
        **({"gradient_checkpointing": False, "padding_free": True} if best else {}),
    )
    if kind == "sft":
        args, cls = trl.SFTConfig(assistant_only_loss=True, **common), trl.SFTTrainer
    else:
        args, cls = trl.DPOConfig(beta=0.1, loss_type=["sigmoid"], **common), trl.DPOTrainer
    step_ends: list[float] = []
    losses: list[float] = []
    steps: list[dict[str, Any]] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_ends.append(time.time())

    class Observed(cls):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, *_: Any, **__: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

        def training_step(self, model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> torch.Tensor:
            seqs = rows_of(inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"))
            mask = inputs["completion_mask"] if "completion_mask" in inputs else inputs["labels"] != -100
            steps.append(step_record(seqs, int(mask.sum())))
            loss = super().training_step(model, inputs, *a, **k)
            losses.append(float(loss))
            return loss

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = Observed(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                       callbacks=[StepEnds()])
    trainer.train()
    group = trainer.optimizer.param_groups[0]
    settings = {
        "optimizer": "adamw" if "adamw" in str(args.optim).lower() else str(args.optim), "lr": group["lr"],
        "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
        "scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "warmup_steps": int(args.warmup_steps), "max_grad_norm": args.max_grad_norm,
        "rows_per_step": args.per_device_train_batch_size * (1 if kind == "sft" else 2),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **({"loss": args.loss_type} if kind == "sft" else {"loss": f"dpo-{args.loss_type[0]}", "beta": args.beta}),
    }
    return child_result(spec, step_ends, losses, steps, settings)
