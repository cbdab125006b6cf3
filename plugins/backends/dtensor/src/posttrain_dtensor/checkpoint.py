"""Saving and exporting sharded weights.

- Training checkpoints: the trainable parameters and the optimizer as a sharded
  torch.distributed.checkpoint (DCP) folder, written by every rank in parallel and loadable
  under any rank layout; the scheduler state and step beside it in ``trainer_state.pt``
  (written by rank 0). Frozen parameters (the base weights under LoRA) are left out: they
  are ``policy.model``'s, loaded again when the policy starts.
- Weight export: full (unsharded) tensors under their Hugging Face names, gathered in
  buckets of bounded size (:mod:`posttrain.backend.hf_export` groups and writes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from posttrain.backend.policy_worker import require_policy_checkpoint

TRAINER_STATE = "trainer_state.pt"
DCP_METADATA = ".metadata"
#: Checkpoints hold what training changes: frozen parameters are not saved or loaded. Loading
#: leaves them as they are (not strict); ``dcp.load`` still requires every trained tensor.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def save_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]) -> None:
    """Collective: write the trainable parameters' and the optimizer's shards and (rank 0) ``trainer_state`` under ``path``."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(trainer_state, Path(path) / TRAINER_STATE)
    dist.barrier()


def load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: restore what :func:`save_sharded` wrote; return the trainer state."""
    folder = require_policy_checkpoint(path, (DCP_METADATA, TRAINER_STATE), "dtensor")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=LOAD_TRAINED)
    return torch.load(folder / TRAINER_STATE, weights_only=False)


def named_weights(lm: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``lm``'s state dict entries under Hugging Face names, each tensor once (a tied output
    embedding is left to the config's ``tie_word_embeddings``). Values may be DTensors."""
    seen: set[int] = set()
    out = []
    for name, tensor in lm.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


def full_nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def gather_full(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Collective for DTensors: the whole tensor, on ``device``, in ``dtype``."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().to(device=device, dtype=dtype if full.is_floating_point() else full.dtype)
