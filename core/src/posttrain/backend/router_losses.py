"""The router losses of a mixture of experts (``policy.moe.aux_loss_coef`` and
``z_loss_coef``) and the expert-load metric, from the router logits of one forward pass.

- **Load balancing** (:func:`load_balancing_loss`): Switch Transformer's loss as transformers
  computes it (``load_balancing_loss_func``, the term TRL adds with ``output_router_logits``):
  over the real tokens of every layer pooled, ``E * sum_e f_e * P_e`` with ``f_e`` the share
  of top-k assignments that went to expert ``e`` and ``P_e`` its mean routing probability. It
  is ``k`` (the experts per token) when the load is even.
- **z-loss** (:func:`z_loss`): ST-MoE's router z-loss, the mean over real tokens and layers of
  ``logsumexp(router_logits) ** 2``: it keeps the router's logits small.
- **Expert load** (:func:`expert_loads`): per layer, the busiest expert's share of the top-k
  assignments over an even share (``1 / E``): 1.0 when balanced, ``E / k`` at most (every
  token picks that expert).

:class:`RouterLogits` records each router's logits (``forward(hidden) -> (logits, ...)``,
transformers 5's routers; :func:`~posttrain.backend.routing.find_routers`) while it records.
"""

from __future__ import annotations

import torch

__all__ = ["RouterLogits", "expert_assignments", "expert_loads", "load_balancing_loss", "z_loss"]

#: Metric names: the router losses (unscaled, their shares of the step) and the expert load per layer.
AUX_LOSS_METRIC = "moe/aux_loss"
Z_LOSS_METRIC = "moe/z_loss"
EXPERT_LOAD_METRIC = "moe/expert_load"


class RouterLogits:
    """Forward hooks on ``routers`` (a model's, :func:`~posttrain.backend.routing.find_routers`)
    that keep each router's logits [N, E] (in layer order) while :attr:`recording`;
    :meth:`take` returns and forgets them."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.recording = False
        #: Which of the tokens the routers see (flattened rows) are real: set by the caller per forward.
        self.valid: torch.Tensor = torch.ones(0, dtype=torch.bool)
        self._logits: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        if self.recording:
            self._logits.append(output[0])

    def take(self) -> list[torch.Tensor]:
        """The logits recorded since the last call, one [N, E] per router call."""
        logits, self._logits = self._logits, []
        return logits


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32 at least (bfloat16 and float16 widened; float64 kept)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def expert_assignments(logits: list[torch.Tensor], valid: torch.Tensor, top_k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, from its router's ``logits`` [N, E] (N tokens in the order of ``valid`` [N],
    whose False tokens are left out): each expert's count of the tokens' ``top_k`` assignments
    and the sum of its routing probabilities ([E] each, float32 at least). What
    :func:`load_balancing_loss` and :func:`expert_loads` take."""
    out = []
    for layer in logits:
        probs = torch.softmax(_wide(layer), dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices
        weight = valid.to(probs.dtype)
        counts = torch.zeros_like(probs[0]).scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        out.append((counts, (probs * weight[:, None]).sum(dim=0)))
    return out


def load_balancing_loss(assignments: list[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of every layer's :func:`expert_assignments`
    over the ``valid`` tokens, pooled over the layers as transformers'
    ``load_balancing_loss_func`` does."""
    counts = sum(layer_counts for layer_counts, _ in assignments)
    probs = sum(layer_probs for _, layer_probs in assignments)
    rows = valid.sum() * len(assignments)
    return (counts / rows * probs / rows).sum() * len(counts)


def z_loss(logits: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over layers and valid tokens of the squared
    log-sum-exp of the router ``logits`` [N, E]."""
    per_layer = [(torch.logsumexp(_wide(layer), dim=-1) ** 2 * valid).sum() / valid.sum() for layer in logits]
    return torch.stack(per_layer).mean()


def expert_loads(assignments: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Per layer, the busiest expert's share of the top-k assignments (:func:`expert_assignments`)
    over an even share (``1 / E``)."""
    return [float(counts.max() / counts.sum() * len(counts)) for counts, _ in assignments]
