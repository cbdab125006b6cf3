"""Expert parallelism: a mixture of experts' experts split over ranks, tokens sent to them by all-to-all.

With ``policy.moe.expert_parallel_size = ep``, the data-parallel ranks form groups of ``ep``
consecutive ranks (the mesh's ``ep`` axis; ``edp`` numbers the groups). Each rank of a group
holds ``E / ep`` of every layer's ``E`` experts: the experts' packed parameters (``[E, ...]``,
transformers' layout) become DTensors sharded on their first dimension over ``ep``, and FSDP
shards them further over ``edp`` (the ranks holding the same experts), while the dense parts
are sharded over all data-parallel ranks as without experts parallelism.

Each rank routes its own tokens with its own (whole) router. The experts module then
(:func:`dispatched_forward`):

1. orders its ``(token, expert)`` assignments by expert, which orders them by the rank owning
   it (expert ``e`` lives on rank ``e // (E / ep)`` of the group);
2. exchanges the counts, then the tokens' hidden states and their experts' local numbers, by
   all-to-all over the group;
3. runs transformers' own experts forward on what it received, with its local experts and a
   routing weight of 1 (so each row comes back as the expert's output alone);
4. sends the outputs back by the reverse all-to-all, weighs each by its routing weight and
   sums each token's ``k`` outputs, as the model's own forward does.

Both all-to-alls carry gradients: a token's gradient goes back to its rank, an expert's
parameters collect the gradients of every token of the group sent to them, and FSDP sums
them over ``edp``. The model is found through its config's ``base_model_ep_plan``
(transformers declares one for the architectures whose experts it can split this way:
Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE and others): the modules of style ``moe_tp_experts``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from posttrain.errors import ConfigError
from posttrain.models.folder import EXPERT_COUNT_KEYS
from posttrain_dtensor.lora import plan_key_matches

#: The style ``base_model_ep_plan`` gives the module holding a layer's packed experts.
EXPERTS_STYLE = "moe_tp_experts"


def experts_patterns(config: object) -> list[str]:
    """The module path patterns (relative to the decoder) of a model's experts modules, from
    its (text) config's ``base_model_ep_plan``; none when it declares no plan."""
    plan = getattr(config.get_text_config(), "base_model_ep_plan", None) or {}
    return [pattern for pattern, style in plan.items() if style == EXPERTS_STYLE]


def check_expert_parallel(config: object, ep_size: int) -> None:
    """Refuse, from the model's config, an expert-parallel size the model cannot be split by:
    a model without experts transformers can split, or a size that does not divide the
    experts of every layer."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", "?")
    if not experts_patterns(config):
        raise ConfigError(
            f"policy.moe.expert_parallel_size={ep_size}, but model type '{model_type}' declares no experts to split "
            "(its transformers config has no base_model_ep_plan with a 'moe_tp_experts' module: a dense model, or "
            "experts transformers does not split by expert); set policy.moe.expert_parallel_size: 1"
        )
    experts = next((getattr(text, key) for key in EXPERT_COUNT_KEYS if isinstance(getattr(text, key, None), int)), None)
    if experts is None or experts % ep_size:
        raise ConfigError(
            f"policy.moe.expert_parallel_size={ep_size} does not divide the model's {experts} experts per layer; "
            f"choose a size that divides {experts} (each rank of an expert-parallel group holds an equal share)"
        )


def experts_modules(decoder: nn.Module) -> list[nn.Module]:
    """The experts modules of ``decoder`` (the base model, or a vision-language model's language
    model), in module order."""
    patterns = experts_patterns(decoder.config)
    return [module for path, module in decoder.named_modules() if any(plan_key_matches(p, path) for p in patterns)]


def split_experts(decoder: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Keep this rank's share of every experts module's parameters (each a DTensor sharded on
    its expert dimension over ``ep_mesh``) and make each module dispatch its tokens by
    all-to-all over the group. Returns the experts modules (FSDP shards each on its own)."""
    ep_size, group = ep_mesh.size(), ep_mesh.get_group()
    modules = experts_modules(decoder)
    for experts in modules:
        total = experts.num_experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] != total:
                raise ConfigError(
                    f"policy.moe.expert_parallel_size: the experts module {type(experts).__name__} holds '{name}' of "
                    f"shape {tuple(param.shape)}, not one entry per expert ({total}); it cannot be split by expert. "
                    "Set policy.moe.expert_parallel_size: 1"
                )
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.num_experts = total // ep_size
        experts.forward = functools.partial(dispatched_forward, experts, experts.forward, group)
    return modules


def dispatched_forward(
    experts: nn.Module,
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' output [T, H] for this rank's tokens ``hidden_states`` [T, H] routed to
    global experts ``top_k_index`` [T, k] with weights ``top_k_weights`` [T, k]: see the module
    docstring. ``forward`` is the module's own forward over local experts."""
    ep_size, local = dist.get_world_size(group), experts.num_experts
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    send_counts = torch.bincount(flat // local, minlength=ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    local_ids = flat.new_empty(sum(recv))
    dist.all_to_all_single(local_ids, flat[order] % local, recv, send, group=group)
    received = funcol.all_to_all_single(hidden_states[token], recv, send, group)
    with local_parameters(experts) as params:
        ones = received.new_ones(len(local_ids), 1)
        outputs = forward(received, local_ids[:, None], ones)
        if not len(local_ids):  # no token for this rank's experts: their gradients are still (zero) tensors,
            outputs = outputs + sum(p.sum() for p in params) * 0.0  # as FSDP's reduction over edp expects
    returned = funcol.all_to_all_single(outputs.contiguous(), send, recv, group)
    weighted = returned * top_k_weights.reshape(-1)[order, None].to(returned.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block, ``module``'s DTensor parameters are their local shards (autograd
    flows back to the DTensors); yields the local tensors."""
    originals = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    local = {name: p.to_local() for name, p in originals.items()}
    module._parameters.update(local)
    try:
        yield list(local.values())
    finally:
        module._parameters.update(originals)
