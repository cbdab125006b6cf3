"""Routing replay (``policy.moe``) on megatron-core's routers.

megatron-core 0.16.1 has replay built into its top-k router: with ``moe_enable_routing_replay``
each router holds a ``RouterReplay`` whose ``get_replay_topk(scores, topk, num_groups,
group_topk, compute_topk)`` chooses the experts, given the scores the router picks from (the
logits, or the softmax over all experts without renormalisation). Its own replay takes every
token's experts from a recorded list; posttrain's routes leave some tokens without one
(:data:`~posttrain.backend.routing.NO_ROUTE`: padding, tokens the engine never ran), whose
router must choose as usual. :class:`MegatronRouters` puts a hook of the same interface in each
router's place: it lets the router choose, keeps its choice (for ``routing_replay: previous``),
counts the agreement with the given routes and, with replay on, returns the given experts with
their scores gathered from the router's, as megatron-core's own replay does (so the weights the
router goes on to compute, e.g. a softmax over the k chosen, are those of the given experts, and
gradients reach the router through them).

Token order: a router sees its layer's input ``[s, b, h]`` flattened, the sequence position
outermost; :func:`lay_out` puts a microbatch's per-sample routes [b, S, layers, k] in that order
(this rank's context-parallel positions and, with sequence parallelism, its part of the
sequence), :meth:`MegatronRouters.take` gives the experts chosen back per sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay

from posttrain.backend.routing import NO_ROUTE, ROUTES_DTYPE, RouteAgreement, replayed
from posttrain_megatron.head import Rows

#: megatron-core's default top-k: ``(scores, topk, num_groups, group_topk) -> (values, indices)``.
ComputeTopk = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def lay_out(routes: torch.Tensor, lengths: torch.Tensor, rows: Rows, tp_part: tuple[int, int] | None) -> torch.Tensor:
    """Per-sample routes [b, S, layers, k] as the routers of a forward on ``rows`` see their
    tokens: [tokens, layers, k], position-major; :data:`NO_ROUTE` past each sample's length,
    whatever the batch was padded with. ``tp_part`` ``(rank, size)``: with sequence
    parallelism, the tensor-parallel rank's part of the sequence."""
    b, width = routes.shape[0], rows.width
    padded = torch.full((b, width, *routes.shape[2:]), NO_ROUTE, dtype=routes.dtype)
    n = min(width, routes.shape[1])
    padded[:, :n] = routes[:, :n]
    real = torch.arange(width)[None, :] < lengths[:, None]
    padded = torch.where(real[..., None, None], padded, NO_ROUTE)
    tokens = padded[:, rows.positions].transpose(0, 1)  # [s, b, layers, k]
    if tp_part is not None:
        tokens = tokens.chunk(tp_part[1], dim=0)[tp_part[0]]
    return tokens.flatten(0, 1)


class _RouterHook:
    """Stands in a router's ``router_replay`` (megatron-core calls ``get_replay_topk``)."""

    def __init__(self, owner: MegatronRouters, slot: int):
        self.owner, self.slot = owner, slot

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None,
                        compute_topk: ComputeTopk) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return self.owner.choose(self.slot, scores, values, own)


class MegatronRouters:
    """The routers of this rank's pipeline stage, given routes and (with ``record``) keeping the
    experts they choose.

    ``moe_layers`` marks the whole model's mixture-of-experts layers; routes carry one entry
    per such layer, in layer order, and this stage's routers use theirs. ``apply``: replay the
    given routes (else only count the agreement with them).
    """

    def __init__(self, model: torch.nn.Module, moe_layers: tuple[bool, ...], *, apply: bool):
        layers = [layer for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
        self.routers = [layer.mlp.router for layer in layers]
        #: this stage's routers' positions among the model's mixture-of-experts layers
        self.indices = [sum(moe_layers[:layer.layer_number - 1]) for layer in layers]
        self.apply = apply
        self.record = False
        self.agreement = RouteAgreement(sum(moe_layers))
        self._routes: torch.Tensor | None = None
        self._own: list[list[torch.Tensor]] = [[] for _ in self.routers]
        for slot, router in enumerate(self.routers):
            router.router_replay = _RouterHook(self, slot)
        RouterReplay.clear_global_router_replay_instances()  # the replaced ones, held by megatron-core's class

    def set(self, routes: torch.Tensor | None) -> None:
        """Routes [tokens, all MoE layers, k] for the forwards that follow (None: routers choose alone)."""
        self._routes = None if routes is None else routes[:, self.indices]

    def choose(self, slot: int, scores: torch.Tensor, values: torch.Tensor,
               own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of router ``slot``: its own, or the given experts under replay."""
        if self.record:
            self._own[slot].append(own.detach().to("cpu", ROUTES_DTYPE))
        if self._routes is None:
            return values, own
        given = self._routes[:, slot]
        if given.shape != own.shape:
            raise ValueError(f"routing replay: {given.shape[0]} tokens of routes with k={given.shape[-1]} for a router "
                             f"forward of {own.shape[0]} tokens with k={own.shape[-1]}")
        self.agreement.count(self.indices[slot], own, given)
        if not self.apply:
            return values, own
        chosen = replayed(own, given)
        return scores.gather(1, chosen), chosen

    def take(self) -> torch.Tensor:
        """The experts this stage's routers chose in the forwards since the last call: int16
        [tokens, layers, k] in the routers' token order (forgotten after)."""
        out = torch.stack([torch.cat(parts) for parts in self._own], dim=1)
        self._own = [[] for _ in self.routers]
        return out

    def agreement_counts(self, groups: list[dist.ProcessGroup], device: torch.device) -> dict[str, float]:
        """The agreement counts since the last call, summed over ``groups`` (the ranks that
        route other tokens or other layers: pipeline stages; tensor-parallel ranks under
        sequence parallelism)."""
        for group in groups:
            for counts in (self.agreement.matched, self.agreement.routed):
                total = counts.to(device)
                dist.all_reduce(total, group=group)
                counts.copy_(total.cpu())
        return self.agreement.counts()

