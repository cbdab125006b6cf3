"""Independent references for routing replay tests: transformers' own mixture-of-experts
models with routers made to return given experts (a forward hook, not posttrain's replay), run
one sample at a time."""

from __future__ import annotations

import torch

from posttrain.backend.routing import NO_ROUTE, Routers
from posttrain.testing.policy import reference_model


def given_router(module: torch.nn.Module, chosen: torch.Tensor) -> torch.utils.hooks.RemovableHandle:
    """A forward hook replacing a router's output with ``chosen`` experts, scored as the
    transformers routers score theirs: softmax over every expert, gathered at the chosen,
    renormalised over them where the architecture does (Mixtral always, Qwen3-MoE by config)."""

    def hook(mod, args, output):
        logits = output[0]
        scores = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        if getattr(mod, "norm_topk_prob", True):
            scores = scores / scores.sum(-1, keepdim=True)
        return logits, scores.to(logits.dtype), chosen

    return module.register_forward_hook(hook)


def shifted_routes(model_path: str, batch) -> torch.Tensor:
    """Every token's experts moved one expert on from the float32 model's own choice, as
    [B, S, layers, k] with NO_ROUTE on padding."""
    model = reference_model(model_path, torch.float32)
    routers = Routers(model, record=True)
    n_experts = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    out = torch.full((*batch["input_ids"].shape, routers.num_layers, model.config.num_experts_per_tok), NO_ROUTE,
                     dtype=torch.int16)
    with torch.no_grad():
        for i, n in enumerate(batch["input_lengths"].tolist()):
            model(batch["input_ids"][i:i + 1, :n])
            out[i, :n] = (routers.take() + 1) % n_experts
    return out


def replayed_reference(model_path: str, batch, temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Float64 logprobs [B, S] (of the logits divided by ``temperature``; 0 off the loss tokens)
    and the token-NLL gradients of a model whose routers return the batch's ``routed_experts``,
    each sample run alone."""
    model = reference_model(model_path)
    routers = Routers(model).modules
    logprobs = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        hooks = [given_router(module, batch["routed_experts"][i, :n, layer].long()) for layer, module in enumerate(routers)]
        ids = batch["input_ids"][i:i + 1, :n]
        logits = model(ids).logits[0, :-1] / temperature
        logprobs[i, 1:n] = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        for hook in hooks:
            hook.remove()
    logprobs = logprobs * batch["token_mask"].double()
    mask = batch["token_mask"].double() * batch["sample_mask"].double()[:, None]
    (-(logprobs * mask).sum() / mask.sum()).backward()
    return logprobs.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}
