"""Writing full weights as a Hugging Face folder, and grouping them into bounded buckets.

Shared by policy backends: weight export for refitting generation engines goes bucket by
bucket (:func:`bucket_names`), and a Hugging Face folder is one safetensors shard per
bucket plus ``model.safetensors.index.json`` (:class:`HFShardWriter`, driven collectively by
:func:`write_hf_shards`), with the model's
config, generation config, tokenizer and processor files beside them (:func:`write_hf_metadata`).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

INDEX_FILE = "model.safetensors.index.json"
#: A vision-language model's processor files beside its tokenizer (the image processor's
#: settings, the processor's own, its chat template when kept apart).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def bucket_names(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` in order into buckets of at most ``bucket_bytes`` bytes; a
    tensor larger than that gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not buckets or used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += nbytes
    return buckets


class HFShardWriter:
    """Writes buckets of full tensors as safetensors shards, then the index (rank 0 only)."""

    def __init__(self, path: str):
        self.folder = Path(path)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, self.folder / name, metadata={"format": "pt"})
        self.files.append(name)
        for key, value in tensors.items():
            self.weight_map[key] = name
            self.total_bytes += value.numel() * value.element_size()

    def finish(self) -> None:
        """Rename shards to Hugging Face's ``model-0000i-of-0000n`` and write the index."""
        n = len(self.files)
        renamed = {}
        for i, old in enumerate(self.files, start=1):
            new = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.folder / old).rename(self.folder / new)
            renamed[old] = new
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: renamed[v] for k, v in sorted(self.weight_map.items())},
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_hf_shards(
    path: str,
    sizes: Sequence[tuple[str, int]],
    gather: Callable[[list[str]], dict[str, torch.Tensor] | None],
    shard_bytes: int,
    writer: bool,
) -> bool:
    """Export full weights bucket by bucket as safetensors shards of at most ``shard_bytes``.

    Collective when ``gather`` is: every rank calls it with the same ``sizes`` (``(name,
    nbytes)`` in export order) and calls ``gather(names)`` once per bucket; the one rank
    with ``writer`` true (its ``gather`` returns the tensors) writes the shards and the
    index under ``path``. Returns ``writer``, so the caller adds the metadata there.
    """
    shards = HFShardWriter(path) if writer else None
    for names in bucket_names(sizes, shard_bytes):
        tensors = gather(names)
        if shards is not None:
            shards.add(tensors)
    if shards is not None:
        shards.finish()
    return writer


def write_hf_metadata(
    path: str,
    hf_config: PretrainedConfig,
    tokenizer_source: str,
    dtype: torch.dtype,
    generation_config: GenerationConfig | None = None,
    model_source: str | None = None,
) -> None:
    """Write ``config.json`` (with ``dtype``), the generation config when given, the tokenizer
    loaded from ``tokenizer_source`` and, for a vision-language model, the processor files
    (:data:`PROCESSOR_FILES`) found there or in ``model_source`` into the Hugging Face folder ``path``."""
    from transformers import AutoTokenizer

    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    config.save_pretrained(path)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(path)
    for name in PROCESSOR_FILES:
        found = [Path(folder) / name for folder in (tokenizer_source, model_source) if folder]
        for file in (f for f in found if f.is_file()):
            shutil.copyfile(file, Path(path) / name)
            break
