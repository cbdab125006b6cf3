"""Optimizer and gradient norm over sharded (DTensor) parameters (the learning-rate schedule
is :mod:`posttrain.backend.lr_schedule`).

Muon (``policy.optimizer.name: muon``, :class:`MuonAdamW`): each 2-D hidden weight steps as
``torch.optim.Muon`` steps it, the other parameters as fused AdamW. The orthogonalisation
needs the whole matrix, so for a sharded weight (FSDP2 or tensor parallel) every rank
gathers the momentum update, orthogonalises it and keeps its own shard of the result; the
momentum buffers stay sharded like their weights. One weight is whole at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from posttrain.config.schema import OptimizerConfig
from posttrain.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd", "muon")


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig, lm: torch.nn.Module | None = None
) -> torch.optim.Optimizer:
    """The optimizer named by ``policy.optimizer.name``. Adam and AdamW use PyTorch's fused
    kernel (one pass over each parameter's state, on CPU and GPU; DTensor shards included):
    the for-each version spent about a sixth of a small model's CPU training step in
    separate element-wise passes. Muon needs ``lm``, the model whose :func:`hidden_matrices`
    among ``params`` it steps; AdamW steps the others."""
    params = list(params)
    if cfg.name == "muon":
        if lm is None:
            raise ValueError("build_optimizer: Muon needs the model (lm) to tell its hidden matrices from its embeddings")
        return MuonAdamW(params, cfg, hidden_matrices(lm, params))
    if cfg.name in ("adamw", "adam"):
        adam = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        return adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ConfigError(f"policy.optimizer.name: expected one of {', '.join(OPTIMIZERS)}, got '{cfg.name}'")


def hidden_matrices(lm: torch.nn.Module, trained: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The trained 2-D weights Muon steps: all but those of the input and output embeddings
    and of a value model's ``score`` head."""
    heads = [lm.get_input_embeddings(), lm.get_output_embeddings(), getattr(lm, "score", None)]
    excluded = {id(p) for module in heads if module is not None for p in module.parameters()}
    return [p for p in trained if p.ndim == 2 and id(p) not in excluded]


class MuonAdamW(torch.optim.AdamW):
    """Muon for ``matrices``, fused AdamW for the other ``params``, in one optimizer (one
    state dict, one schedule). Muon's groups carry ``muon: True``; a step on a weight that is
    not a DTensor is ``torch.optim.Muon``'s, bit for bit."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimizerConfig, matrices: Iterable[torch.nn.Parameter]):
        muon = cfg.muon
        chosen = {id(p) for p in matrices}
        groups = [
            {"params": [p for p in params if id(p) in chosen], "muon": True,
             "lr": cfg.lr if muon.lr is None else muon.lr,
             "weight_decay": cfg.weight_decay if muon.weight_decay is None else muon.weight_decay,
             "momentum": muon.momentum, "nesterov": muon.nesterov, "ns_steps": muon.ns_steps,
             "adjust_lr_fn": muon.adjust_lr_fn},
            {"params": [p for p in params if id(p) not in chosen], "muon": False},
        ]
        super().__init__([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                         weight_decay=cfg.weight_decay, fused=True)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW takes no closure"
        groups = self.param_groups
        for group in groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_step(p, group)
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            if self.param_groups:
                super().step()
        finally:
            self.param_groups = groups

    def _muon_step(self, p: torch.nn.Parameter, group: dict) -> None:
        """``torch.optim.Muon``'s step of one weight (its default coefficients and epsilon),
        orthogonalising the whole update of a sharded one."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(0.0)  # counted as AdamW counts, whose state loading expects it
        state["step"] += 1
        grad, buf, momentum = p.grad, state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        sharded = isinstance(update, DTensor)
        whole = update.full_tensor() if sharded else update
        ortho = _zeropower_via_newtonschulz(whole, (DEFAULT_A, DEFAULT_B, DEFAULT_C), group["ns_steps"], EPS)
        if sharded:  # this rank's part of the result every rank computed
            ortho = distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients as one vector, identical on every rank (float32 scalar).

    A DTensor gradient contributes the squares of its local shard, summed over the mesh
    dimensions it is sharded on and counted once over the dimensions it is replicated on.
    Every rank must call this with the same parameters in the same order.
    """
    sums: dict[tuple, torch.Tensor] = {}
    groups: dict[tuple, list] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())
            key = (id(g.device_mesh), dims)
            groups[key] = [g.device_mesh.get_group(i) for i in dims]
            local = g.to_local()
        else:
            key, local = (), g
        sq = torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()  # no copy of the gradient
        sums[key] = sums[key] + sq if key in sums else sq
    total = torch.zeros(())
    for key, sq in sums.items():
        for group in groups.get(key, []):
            dist.all_reduce(sq, group=group)
        total = total + sq.cpu()
    return total.sqrt()


def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so their total norm is at most ``max_norm``."""
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
