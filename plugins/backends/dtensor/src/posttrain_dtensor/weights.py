"""What the policy exports and syncs, by name: a view over the (sharded) model.

- :class:`FullWeights`: every weight under its Hugging Face name (full fine-tuning).
- :class:`MergedWeights`: with LoRA, the model as the base architecture sees it: each adapted
  layer's weight is ``W + (alpha / r) B A`` (as peft's ``merge_and_unload`` computes it) under
  the base layer's name, so every generation engine and transformers load it unchanged.
- :class:`AdapterWeights`: with LoRA, the adapter matrices only, under PEFT's names
  (:mod:`posttrain.backend.adapter_folder`).

``named()`` gives ``(name, tensor)`` with each tensor of the exported shape (no gather; a
DTensor's shape is the full one); ``gather(names, dtype)`` is a collective (every rank calls it
with the same names) returning the full tensors on CPU in ``dtype`` to every rank that asks
(the worker keeps rank 0's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from posttrain.backend.adapter_folder import MATRICES, peft_name
from posttrain_dtensor.checkpoint import gather_full, named_weights
from posttrain_dtensor.lora import ADAPTER


class WeightView(Protocol):
    def named(self) -> list[tuple[str, torch.Tensor]]: ...

    def gather(self, names: list[str], dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Collective: the named full tensors, in ``dtype``, on ``device``."""
        ...


class FullWeights:
    """Every tensor of the model's state dict, each once, under its Hugging Face name."""

    def __init__(self, lm: nn.Module):
        self.lm = lm

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return named_weights(self.lm)

    def gather(self, names: list[str], dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        tensors = dict(self.named())
        return {name: gather_full(tensors[name], dtype, device) for name in names}


def _adapter_tensor(lm_tensors: dict[str, torch.Tensor], path: str, matrix: str) -> torch.Tensor:
    return lm_tensors[f"{path}.{matrix}.{ADAPTER}.weight"]


class MergedWeights:
    """The base model's tensors with every adapter merged in (see the module docstring).
    ``scales``: each adapted layer's module path (relative to ``lm``) and ``alpha / rank``."""

    def __init__(self, lm: nn.Module, scales: dict[str, float]):
        self.lm = lm
        self.scales = scales

    def _entries(self) -> Iterator[tuple[str, str]]:
        """``(exported name, state-dict name)`` of every exported tensor, in state-dict order."""
        adapter = {f"{path}.{m}.{ADAPTER}.weight" for path in self.scales for m in MATRICES}
        for name, _ in named_weights(self.lm):
            if name in adapter:
                continue
            yield name.replace(".base_layer.", "."), name

    def named(self) -> list[tuple[str, torch.Tensor]]:
        tensors = dict(named_weights(self.lm))
        return [(exported, tensors[name]) for exported, name in self._entries()]

    def gather(self, names: list[str], dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        tensors = dict(named_weights(self.lm))
        source = dict(self._entries())
        out = {}
        for name in names:
            full = gather_full(tensors[source[name]], torch.float32, device)
            path = name.removesuffix(".weight")
            if name.endswith(".weight") and path in self.scales:
                a = gather_full(_adapter_tensor(tensors, path, "lora_A"), torch.float32, device)
                b = gather_full(_adapter_tensor(tensors, path, "lora_B"), torch.float32, device)
                full = full + (b @ a) * self.scales[path]  # peft's get_delta_weight, then merge
            out[name] = full.to(dtype)
        return out


class AdapterWeights:
    """The adapter matrices ``A`` and ``B`` of every adapted layer, under PEFT's names."""

    def __init__(self, lm: nn.Module, scales: dict[str, float]):
        self.lm = lm
        self.scales = scales

    def _entries(self) -> list[tuple[str, str, str]]:
        return [(peft_name(path, m), path, m) for path in self.scales for m in MATRICES]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        tensors = dict(named_weights(self.lm))
        return [(name, _adapter_tensor(tensors, path, m)) for name, path, m in self._entries()]

    def gather(self, names: list[str], dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        tensors = dict(self.named())
        return {name: gather_full(tensors[name], dtype, device) for name in names}
