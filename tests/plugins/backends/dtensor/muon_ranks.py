"""Two CPU ranks (gloo) step :class:`~posttrain_dtensor.optim.MuonAdamW` on a model sharded as
the dtensor backend shards it, FSDP2 (``dp2``) or tensor parallel (``tp2``), three times from
the same full gradients as one rank; rank 0 saves the full weights after the steps.

    python -m tests.plugins.backends.dtensor.muon_ranks MODEL LAYOUT OUT
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, distribute_tensor

from posttrain.config.schema import MuonConfig, OptimizerConfig
from posttrain_dtensor.optim import MuonAdamW, hidden_matrices
from posttrain_dtensor.parallel import apply_fsdp, apply_tensor_parallel, build_meshes

MUON = OptimizerConfig(name="muon", lr=0.02, weight_decay=0.1, muon=MuonConfig(lr=0.05, weight_decay=0.01))
STEPS = 3


def gradients(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """A seeded full gradient per step for every parameter of ``model`` (by name)."""
    g = torch.Generator().manual_seed(0)
    return [{name: torch.randn(p.shape, generator=g) * 0.01 for name, p in model.named_parameters()}
            for _ in range(STEPS)]


def stepped(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights after :data:`STEPS` steps of ``model`` (sharded or not) with
    :func:`gradients`, each given in the parameter's own layout."""
    params = list(model.parameters())
    optimizer = MuonAdamW(params, MUON, hidden_matrices(model.lm if hasattr(model, "lm") else model, params))
    for grads in gradients(model):
        for name, p in model.named_parameters():
            full = grads[name]
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else full
        optimizer.step()
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for name, p in model.named_parameters()}


def load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def rank_main(rank: int, path: str, layout: str, out: str, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = load(path)
        if layout == "tp2":
            apply_tensor_parallel(model, build_meshes("cpu", 1, 2).tp)
        else:
            model = apply_fsdp(model, build_meshes("cpu", 2, 1), param_dtype=torch.float32,
                               reduce_dtype=torch.float32, reshard_after_forward=True)
        weights = stepped(model)
        if rank == 0:
            torch.save({name.removeprefix("lm."): w for name, w in weights.items()}, out)
        dist.barrier()  # both ranks done with every collective before gloo's threads stop
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    model_path, layout_name, out_path = sys.argv[1:]
    with tempfile.NamedTemporaryFile() as rendezvous:
        mp.spawn(rank_main, args=(model_path, layout_name, out_path, rendezvous.name), nprocs=2)
