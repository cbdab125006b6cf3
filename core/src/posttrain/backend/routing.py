"""Routing replay for mixtures of experts: record the experts a model's routers choose for each
token, and make them choose given experts instead.

transformers 5 gives each mixture-of-experts architecture a router module (``Qwen3MoeTopKRouter``,
``MixtralTopKRouter``, ...): ``forward(hidden) -> (logits, scores, indices)``, where ``indices``
[N, k] are the experts of the N tokens of the forward (the input flattened in row-major order)
and are chosen by one ``torch.topk`` over the routing probabilities. :class:`Routers` wraps each
router's ``forward`` and intercepts that ``topk``:

- it keeps the experts the router chose itself (:meth:`Routers.take`, in layer order);
- given routes (:meth:`Routers.set`: [N, layers, k], :data:`NO_ROUTE` where a token has none),
  it counts, per layer, the tokens whose own experts are the given ones (as sets), and with
  ``apply`` it returns the given experts with their probabilities gathered from the router's
  own, so the scores the router goes on to compute (e.g. renormalised over the k chosen) are
  those of the given experts, and gradients reach the router through them.

A routes tensor is int16 [..., layers, k]; one token's row is all :data:`NO_ROUTE` or all
experts. The batch field of per-token routes is :data:`ROUTES_FIELD` ([B, S, layers, k],
position ``t`` the experts that token ``t`` went through).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from posttrain.interfaces.generation import ROUTES_FIELD

__all__ = [
    "NO_ROUTE",
    "ROUTES_DTYPE",
    "ROUTES_FIELD",
    "RouteAgreement",
    "Routers",
    "agreement_metrics",
    "find_routers",
    "padded_routes",
    "replayed",
]

#: A token without a route (padding, or a token the engine never ran): the router chooses.
NO_ROUTE = -1
ROUTES_DTYPE = torch.int16
#: Metric names: the overall agreement and one per layer (``moe/router_agreement/layer_03``).
AGREEMENT_METRIC = "moe/router_agreement"
_MATCHED = "moe/router_matched_tokens"
_ROUTED = "moe/router_routed_tokens"


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of ``model`` in module order (layer order): those whose class name
    ends in ``TopKRouter``, transformers 5's naming for every mixture-of-experts router."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


def padded_routes(rows: Sequence[torch.Tensor | None], width: int) -> torch.Tensor:
    """Per-row routes [n_i, layers, k] as one [len(rows), width, layers, k] tensor, each row
    right-padded with :data:`NO_ROUTE` (a row of None or no tokens: all of it)."""
    layers, k = next((r.shape[1:] for r in rows if r is not None and r.numel()), (0, 0))
    out = torch.full((len(rows), width, layers, k), NO_ROUTE, dtype=ROUTES_DTYPE)
    for i, routes in enumerate(rows):
        if routes is not None and routes.numel():
            out[i, :len(routes)] = routes
    return out


def replayed(own: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The experts [N, k] a router uses under replay: the ``given`` ones, its ``own`` where a
    token's given row is :data:`NO_ROUTE`."""
    given = given.to(own.device, own.dtype)
    return torch.where((given >= 0).all(-1, keepdim=True), given, own)


class RouteAgreement:
    """Per layer, the tokens given a route and those whose router chose the given experts itself
    (as sets), counted over forwards until :meth:`counts` takes them."""

    def __init__(self, num_layers: int):
        self.matched = torch.zeros(num_layers, dtype=torch.long)
        self.routed = torch.zeros(num_layers, dtype=torch.long)

    def count(self, layer: int, own: torch.Tensor, given: torch.Tensor) -> None:
        """Count a forward's tokens: ``own`` [N, k] the router's experts, ``given`` [N, k] (rows of
        :data:`NO_ROUTE` are not counted)."""
        valid = (given >= 0).all(-1).to(own.device)
        same = (own.sort(-1).values == given.to(own.device, own.dtype).sort(-1).values).all(-1)
        self.matched[layer] += int((same & valid).sum())
        self.routed[layer] += int(valid.sum())

    def counts(self) -> dict[str, float]:
        """The counts since the last call (then reset) as metrics that add up over microbatches
        and ranks; :func:`agreement_metrics` turns their sums into fractions. Empty when no
        routes were given."""
        if int(self.routed.sum()) == 0:
            return {}
        out = {f"{_ROUTED}/layer_{i:02d}": float(n) for i, n in enumerate(self.routed.tolist())}
        out.update({f"{_MATCHED}/layer_{i:02d}": float(n) for i, n in enumerate(self.matched.tolist())})
        self.matched.zero_()
        self.routed.zero_()
        return out


class _ChooseExperts(TorchFunctionMode):
    """Inside one router's ``forward``: intercept its ``topk``, keep the experts it chose, and
    return ``forced`` ([N, k]; rows of :data:`NO_ROUTE` keep the router's own) when given."""

    def __init__(self, forced: torch.Tensor | None):
        super().__init__()
        self.forced = forced
        self.own: torch.Tensor | None = None
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        self.calls += 1
        values, indices = func(*args, **kwargs)
        self.own = indices
        if self.forced is None:
            return values, indices
        probs = args[0]
        if self.forced.shape != indices.shape:
            raise ValueError(f"routing replay: {self.forced.shape[0]} tokens of routes with k={self.forced.shape[-1]} "
                             f"for a router forward of {indices.shape[0]} tokens with k={indices.shape[-1]}")
        chosen = replayed(indices, self.forced)
        return torch.return_types.topk((probs.gather(-1, chosen), chosen))


class Routers:
    """The routers of ``model`` (:func:`find_routers`), wrapped to replay routes and, with
    ``record``, to keep the experts they choose (:meth:`take`).

    Raises :class:`ValueError` when the model has no router. The wrapper is an attribute of
    each router instance (``forward``), so it runs inside sharding and activation
    checkpointing; routes given with :meth:`set` stay until the next :meth:`set`, so a
    checkpointed layer recomputed in the backward pass routes as its forward did.
    """

    def __init__(self, model: torch.nn.Module, *, record: bool = False):
        self.modules = find_routers(model)
        self.record = record
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router (a module named *TopKRouter)")
        self._routes: torch.Tensor | None = None
        self._apply = False
        self._own: list[list[torch.Tensor]] = [[] for _ in self.modules]
        self.agreement = RouteAgreement(len(self.modules))
        for layer, module in enumerate(self.modules):
            module.forward = types.MethodType(self._wrapped(layer, module.forward), module)

    @property
    def num_layers(self) -> int:
        return len(self.modules)

    def _wrapped(self, layer: int, original: Any) -> Any:
        def forward(module: torch.nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            given = None if self._routes is None else self._routes[:, layer]
            mode = _ChooseExperts(given if self._apply else None)
            with mode:
                out = original(hidden, *args, **kwargs)
            if mode.calls != 1 or mode.own is None:
                raise ValueError(f"routing replay: {type(module).__name__} called torch.topk {mode.calls} times in one "
                                 "forward; replay supports routers that choose experts with one topk")
            own = mode.own.detach()
            if self.record:
                self._own[layer].append(own.to("cpu", ROUTES_DTYPE))
            if given is not None:
                self.agreement.count(layer, own, given)
            return out

        return forward

    def set(self, routes: torch.Tensor | None, *, apply: bool = True) -> None:
        """Routes [N, layers, k] for the forwards that follow (None: routers choose alone):
        counted against the routers' own choices, and used instead of them with ``apply``."""
        if routes is not None and routes.shape[-2] != self.num_layers:
            raise ValueError(f"routing replay: routes of {routes.shape[-2]} layers for a model with "
                             f"{self.num_layers} routers")
        self._routes = routes
        self._apply = apply

    def take(self) -> torch.Tensor:
        """The experts the routers chose themselves in the forwards since the last call:
        int16 [N, layers, k], forwards concatenated in order (and forgotten)."""
        if not self._own[0]:
            return torch.empty((0, self.num_layers, 0), dtype=ROUTES_DTYPE)
        out = torch.stack([torch.cat(parts) for parts in self._own], dim=1)
        self._own = [[] for _ in self.modules]
        return out

    def agreement_counts(self) -> dict[str, float]:
        """:meth:`RouteAgreement.counts` of the forwards since the last call."""
        return self.agreement.counts()


def agreement_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with the summed counts of :meth:`Routers.agreement_counts` replaced by
    fractions: ``moe/router_agreement`` (over every layer's tokens) and one per layer
    (``moe/router_agreement/layer_00``...)."""
    layers = sorted(name.rsplit("/", 1)[1] for name in metrics if name.startswith(_ROUTED + "/"))
    if not layers:
        return metrics
    out = {name: value for name, value in metrics.items() if not name.startswith((_MATCHED, _ROUTED))}
    matched = [metrics.get(f"{_MATCHED}/{layer}", 0.0) for layer in layers]
    routed = [metrics[f"{_ROUTED}/{layer}"] for layer in layers]
    out[AGREEMENT_METRIC] = sum(matched) / max(sum(routed), 1.0)
    for layer, m, r in zip(layers, matched, routed, strict=True):
        out[f"{AGREEMENT_METRIC}/{layer}"] = m / max(r, 1.0)
    return out
