"""LoRA adapters as a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``,
which ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load.

Tensor names are PEFT's: ``base_model.model.<module path>.lora_A.weight`` (rank x in) and
``...lora_B.weight`` (out x rank), with the adapted layer's output ``W x + (alpha / r) B A x``.
Written by a policy backend's export and by a generation engine that receives adapters
(a refit with ``policy.lora.refit: adapter``); both derive the config from ``policy.lora`` and
the tensor names, so they write the same file. Needs neither peft nor vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from posttrain.config.schema import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: The folder, inside an exported adapter folder, that holds the merged model when asked for
#: (``policy.lora.export_merged``).
MERGED_FOLDER = "merged"
PREFIX = "base_model.model."
MATRICES = ("lora_A", "lora_B")


def peft_name(module_path: str, matrix: str) -> str:
    """The PEFT file's name of ``matrix`` (``lora_A`` or ``lora_B``) of the layer at ``module_path``."""
    return f"{PREFIX}{module_path}.{matrix}.weight"


def adapted_paths(names: Iterable[str]) -> list[str]:
    """The module paths of the layers that PEFT tensor ``names`` adapt, sorted."""
    paths = set()
    for name in names:
        body = name.removeprefix(PREFIX).removesuffix(".weight")
        path, _, matrix = body.rpartition(".")
        if not name.startswith(PREFIX) or matrix not in MATRICES:
            raise ValueError(f"'{name}' is not a PEFT LoRA tensor name ({PREFIX}<module>.lora_A|lora_B.weight)")
        paths.add(path)
    return sorted(paths)


def adapter_config(lora: LoraConfig, base_model: str, names: Iterable[str]) -> dict[str, Any]:
    """A PEFT LoRA config for the tensors ``names``: ``policy.lora``'s rank, alpha and dropout,
    and as target modules the full paths of the adapted layers (each matches itself only)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": adapted_paths(names),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter_folder(path: str | Path, tensors: Mapping[str, torch.Tensor], lora: LoraConfig,
                         base_model: str) -> Path:
    """Write ``tensors`` (PEFT names) and their config as a PEFT folder at ``path``; return it."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = adapter_config(lora, base_model, tensors)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder
