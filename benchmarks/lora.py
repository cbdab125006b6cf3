"""LoRA against full fine-tuning on the same model, data and optimizer, side by side.

    python benchmarks/lora.py --model small --reps 2 --out DIR

Sides, each in its own process (so its peak memory is its own), alternating per repetition:

- ``full`` (the baseline): the ``dtensor`` policy training every weight;
- ``lora``: ``policy.lora`` (rank ``--rank``, alpha 2 x rank, every linear layer but the head),
  refit ``merged``;
- ``lora-adapter``: the same training with ``policy.lora.refit: adapter``.

Each trains ``warmup + steps`` SFT steps (AdamW, constant ``--lr``, float32, one worker, 16
conversations of skewed lengths per step through :meth:`Policy.train` with the SFT loss) and
reports per step the wall time of ``train`` and the loss (step 1 must agree on every side:
the adapters start at B = 0). Then, measured on what the run holds: the trained parameters;
the optimizer state and trained weights, in bytes, as the policy's checkpoint stores them
(DCP metadata: a checkpoint holds exactly the trained tensors and their optimizer state); and
what one refit sends (the weight sync's plan: the tensors of ``weight_metadata``). Refit
*time* into vLLM, merged and adapter-only, is ``refit.py``'s ``posttrain-vllm-lora-*`` sides.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Workload, child_result, forward_flops, main, step_record  # noqa: E402
from sft import write_conversations  # noqa: E402

SIDES = {"full": None, "lora": "merged", "lora-adapter": "adapter"}


def checkpoint_bytes(path: Path) -> dict[str, int]:
    """Bytes of the trained tensors (``model.``) and the optimizer state (``optimizer.state.``)
    a DCP checkpoint at ``path`` holds, from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    sizes = {"model": 0, "optimizer": 0}
    for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if not hasattr(meta, "size"):
            continue
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize if len(meta.size) else meta.properties.dtype.itemsize
        if key.startswith("model."):
            sizes["model"] += nbytes
        elif key.startswith("optimizer.state."):
            sizes["optimizer"] += nbytes
    return sizes


def lora_side(spec: dict[str, Any], refit: str | None) -> dict[str, Any]:
    """Train ``warmup + steps`` SFT steps (full fine-tuning when ``refit`` is None, else LoRA
    with that refit mode) and report the step times, losses and the sizes above."""
    from posttrain.backend.policy_worker import PolicyWorker
    from posttrain.config import config_from_dict
    from posttrain.data import dataloader_from_config, dataset_from_config, encoder_from_config
    from posttrain.distributed.cluster import VirtualCluster, init_ray
    from posttrain.plugins import plugin_host
    from posttrain_sft.loss import NLLLoss

    rows, threads = spec["rows_per_step"], spec["threads"]
    lora = {"enabled": refit is not None, "rank": spec["rank"], "alpha": 2.0 * spec["rank"], "refit": refit or "merged"}
    config = config_from_dict({
        "seed": spec["seed"], "run_dir": str(Path(spec["workdir"]) / f"lora_{time.time_ns()}"),
        "cluster": {"num_cpus": threads},
        "policy": {
            "backend": "dtensor", "model": spec["model_dir"], "dtype": "float32", "num_workers": 1,
            "train_global_batch_size": rows, "train_micro_batch_size": rows, "max_total_sequence_length": spec["max_len"],
            "sequence_packing": {"enabled": True, "max_tokens_per_row": rows * spec["max_len"]},
            "optimizer": {"name": "adamw", "lr": spec["lr"]}, "lora": lora,
            "resources": {"cpus": threads, "env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        "generation": {"backend": "vllm"},
        "data": {"train": spec["data"], "shuffle": False, "max_length": spec["max_len"]},
    }, source="benchmark")
    init_ray(config.cluster)
    cluster = VirtualCluster(config.cluster)
    policy = plugin_host().policy_backends["dtensor"](config, cluster)
    loader = dataloader_from_config(config, dataset_from_config(config, "train", "sft", encoder_from_config(config)), rows)
    step_ends, losses, steps = [time.time()], [], []
    try:
        for _, batch in zip(range(spec["warmup"] + spec["steps"]), loader, strict=False):
            losses.append(policy.train(batch, NLLLoss())["loss"])
            step_ends.append(time.time())
            seqs = [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["input_lengths"], strict=True)]
            steps.append(step_record(seqs, int(batch["token_mask"].sum())))
        folder = Path(config.run_dir) / "checkpoint"
        policy.save_checkpoint(str(folder))
        refit_bytes = sum(meta.nbytes for meta in policy.group.run_rank0(PolicyWorker.weight_metadata))
        info = policy.info()
    finally:
        policy.shutdown()
        cluster.shutdown()
    p = config.policy
    settings = {"optimizer": p.optimizer.name, "lr": p.optimizer.lr, "rows_per_step": rows, "dtype": p.dtype,
                "max_grad_norm": p.max_grad_norm, "loss": "nll"}
    stored = checkpoint_bytes(folder)
    return {
        **child_result(spec, step_ends[1:], losses, steps, settings),
        "trained_parameters": info["trained_parameters"], "parameters": info["parameters"],
        "trained_bytes": stored["model"], "optimizer_state_bytes": stored["optimizer"], "refit_bytes": refit_bytes,
        "refit": refit or "full weights", "rank": spec["rank"] if refit else None,
    }


def lora_extras(reps: list[dict[str, Any]], spec: dict[str, Any], hf_config: Any, rate: float) -> dict[str, Any]:
    """A side's sizes (the same in every repetition: checked here)."""
    keys = ("trained_parameters", "parameters", "trained_bytes", "optimizer_state_bytes", "refit_bytes", "refit", "rank")
    first = {key: reps[0][key] for key in keys}
    assert all({key: r[key] for key in keys} == first for r in reps), "sizes differ between repetitions"
    return first


def lora_table(result: dict[str, Any]) -> str:
    """Sizes and memory of each side, after the common step-time table."""
    rank = next((s["rank"] for s in result["sides"].values() if s["rank"]), None)
    lines = ["", f"LoRA rank {rank}, alpha {2 * rank if rank else None}: what each side holds and sends (trained weights "
             "and optimizer state as its checkpoint stores them; a refit's bytes from the sync plan).", "",
             "| side | trained parameters | trained weights MB | optimizer state MB | refit sends | refit MB | peak RSS MB |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for name, s in result["sides"].items():
        lines.append(
            f"| {name} | {s['trained_parameters'] / 1e6:.2f}M of {s['parameters'] / 1e6:.2f}M | {s['trained_bytes'] / 1e6:.1f} "
            f"| {s['optimizer_state_bytes'] / 1e6:.1f} | {s['refit']} | {s['refit_bytes'] / 1e6:.1f} | {s['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


WORKLOAD = Workload(
    name="lora",
    script=Path(__file__).resolve(),
    sides={name: (lambda spec, refit=refit: lora_side(spec, refit)) for name, refit in SIDES.items()},
    baseline="full",
    write_data=write_conversations,
    step_flops=lambda config, lengths: 3 * forward_flops(config, lengths),
    rows_per_step=16,
    flops_rule="training: 3 x forward over the real tokens (LoRA skips the frozen weights' gradients: less)",
    options={"rank": {"type": int, "default": 16, "help": "LoRA rank of the lora sides"}},
    side_extras=lora_extras,
    extra_table=lora_table,
    defaults={"lr": 1e-4},
)

if __name__ == "__main__":
    main(WORKLOAD)
