"""megatron-core's optimizers on torch's Adam, which megatron-core 0.16 falls back to when
neither Apex nor Transformer Engine is installed (always on CPU; on GPUs without them).

Fused Adam keeps the step count in its parameter groups; torch's Adam keeps a ``step``
tensor in every parameter's state, created at the first step. megatron-core's handling of
the latter has three gaps, closed here, and only where the fallback is in use:

1. Its distributed optimizer reads the step from that per-parameter state whenever it
   writes or reads a checkpoint, which fails before the first step. :func:`create_state`
   creates the state right away with the values torch gives it at the first step (step 0,
   zero moments), so the first step is unchanged.
2. Loading a checkpoint hands every parameter one shared ``step`` tensor, which torch then
   increments once per parameter at each step (corrupting Adam's bias correction).
   :func:`unshare_steps` gives each parameter its own copy again.
3. Loading its ``fully_reshardable`` checkpoint format copies every per-parameter state
   entry from the file, but the file holds no ``step`` (megatron-core restores it from the
   parameter groups), so loading raises ``KeyError: 'step'``. :func:`apply` makes that copy
   skip entries the file does not hold.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False


def in_use() -> bool:
    """True when megatron-core's optimizers run on torch's Adam."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def apply() -> None:
    """Item 3 of the module docstring. Idempotent; does nothing where Apex or Transformer
    Engine provide the optimizer."""
    global _APPLIED
    if _APPLIED or not in_use():
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        kept = {k: v for k, v in self.optimizer.state[main_param].items() if k not in tensors}
        return original(self, model_param, {**tensors, **kept})

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    _APPLIED = True


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def create_state(optimizer) -> None:
    """Item 1: torch Adam's per-parameter state, as torch would create it at step 0."""
    if not in_use():
        return
    for inner in _torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


def unshare_steps(optimizer) -> None:
    """Item 2: one ``step`` tensor per parameter after a checkpoint load."""
    if not in_use():
        return
    for inner in _torch_optimizers(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
