"""SDPA for decoding on the CPU with grouped-query heads shared, not copied.

transformers' ``sdpa`` attention copies the keys and values of every grouped-query head
group (``repeat_kv``) whenever it has an attention mask on a CPU tensor, which the hf
engine always has: prompts are left-padded. For a decoding step that is the whole KV cache
copied ``heads / kv_heads`` times per layer. PyTorch's CPU kernel takes the mask and the
shared heads together (``enable_gqa``), with the same result.

:data:`SHARED_KV_SDPA` names :func:`shared_kv_sdpa` in transformers' ``AttentionInterface``
and gives it the ``sdpa`` mask builder, so the model gets the masks it gets with ``sdpa``.
Without a mask, or off the CPU (where a masked grouped-query call would leave the fused
kernels for the math one), it is transformers' ``sdpa``. Sliding windows are in the masks
transformers builds for each layer type. A layer's attention logit soft-cap (the ``softcap``
keyword: Gemma 2), which SDPA cannot apply and transformers' ``sdpa`` drops, is applied on
explicit scores (:func:`posttrain.backend.attention.scores_attention`), on every device.

:func:`takes_ready_step_masks` says when the decode loop may hand a decoding step that mask
ready-made instead of the 2-D padding mask transformers rebuilds it from at every step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from posttrain.backend.attention import scores_attention, window_mask

SHARED_KV_SDPA = "posttrain_shared_kv_sdpa"


def shared_kv_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention output ``[rows, tokens, heads, head_dim]`` of ``query`` ``[rows, heads,
    tokens, head_dim]`` over ``key``/``value`` ``[rows, kv_heads, kv_tokens, head_dim]``
    under ``attention_mask`` (``sdpa``'s boolean mask, True where a query sees a key; None:
    causal, the queries being the last keys), scores soft-capped with ``softcap``."""
    if softcap is not None:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(f"{SHARED_KV_SDPA} soft-caps scores under a boolean mask, got a {attention_mask.dtype} one")
        queries, keys = query.shape[2], key.shape[2]
        allowed = attention_mask if attention_mask is not None else window_mask(queries, keys, None, query.device)
        out = scores_attention(query, key, value, allowed, scale=scaling, softcap=softcap, dropout=dropout)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None or query.device.type != "cpu" or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def takes_ready_step_masks(config: PretrainedConfig) -> bool:
    """Whether a decoding step (one new token per row) may be given its mask ready-made:
    ``sdpa``'s boolean ``[rows, 1, 1, keys]``, True where the row's new token sees a key, which
    is the 2-D padding mask as it stands. transformers would build the same mask from the
    2-D one at every step (a tenth of the tiny model's decoding time on a CPU).

    Only for :data:`SHARED_KV_SDPA` (eager attention adds its mask as numbers) and where every
    layer sees the whole sequence: transformers passes a 4-D mask through unchanged, which
    would drop a sliding window or an attention chunk."""
    if config._attn_implementation != SHARED_KV_SDPA:
        return False
    if getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None) is not None:
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())


AttentionInterface.register(SHARED_KV_SDPA, shared_kv_sdpa)
AttentionMaskInterface.register(SHARED_KV_SDPA, sdpa_mask)
