"""A model's tensors as a Hugging Face checkpoint stores them, from the names and shapes
transformers gives them in memory.

transformers 5 converts some checkpoints as it loads them: a Mixtral's or Qwen3-MoE's
per-expert matrices (``mlp.experts.3.gate_proj.weight``, ``block_sparse_moe.experts.3.w1.weight``)
become one packed tensor per layer (``mlp.experts.gate_up_proj`` [experts, 2 x
intermediate, hidden], gate rows first; ``mlp.experts.down_proj``), and Mixtral's
``block_sparse_moe`` is renamed ``mlp``. ``save_pretrained`` undoes this; so must every
export that other programs read (a Hugging Face folder, vLLM's weight loaders, which know
the checkpoint names). :func:`checkpoint_tensors` applies transformers' own inverse
(``revert_weight_conversion``). Each in-memory tensor converts on its own (for the
conversions transformers 5.18 registers: renames, and packed experts split back per
expert), so a bucket of whole tensors converts without the rest of the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def conversion_model(config: Any) -> Any:
    """A transformers causal LM of ``config`` (a ``PretrainedConfig``) on the meta device (no
    memory): what :func:`checkpoint_tensors` needs to know a model's conversions where only
    its config is at hand (a generation engine)."""
    from posttrain.models.auto import generative_class

    with torch.device("meta"):
        return generative_class(config).from_config(config)


def has_conversions(model: Any) -> bool:
    """Whether transformers stores ``model``'s tensors under other names or shapes on disk."""
    return bool(_conversions(model))


def checkpoint_tensors(model: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``tensors`` (in-memory names of ``model``, a transformers model) as its checkpoint holds
    them: renamed and split by transformers' inverse conversions, unchanged for a model
    without any. The results may be views of the inputs."""
    tensors = list(tensors)
    if not _conversions(model):
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(model, dict(tensors)).items())


def _conversions(model: Any) -> list[Any]:
    """The conversions transformers applies when loading ``model``'s checkpoint: those it
    recorded while loading (``from_pretrained``), else the ones registered for its model
    type, which this caches on the model (transformers would rebuild them on every call)."""
    found = getattr(model, "_weight_conversions", None)
    if found is None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        found = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
        model._weight_conversions = found
    return list(found)
