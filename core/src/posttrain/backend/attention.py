"""Attention features PyTorch's fused kernel leaves out, for policy and generation backends.

``F.scaled_dot_product_attention`` takes a mask but has no soft-cap on the scores: Gemma 2
bounds every attention score with ``softcap * tanh(score / softcap)`` before the softmax
(transformers' ``softcap`` keyword of an attention function). :func:`scores_attention`
computes attention from explicit scores, the arithmetic of transformers' eager kernels, so a
backend can honour the cap. :func:`window_mask` is the causal mask of a sliding window, as
transformers builds it (a query sees itself and the ``window - 1`` keys before it).
"""

from __future__ import annotations

import torch


def window_mask(queries: int, keys: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[queries, keys]``, True where a query sees a key: the queries are the last
    ``queries`` positions of the ``keys``; query position ``p`` sees key position ``j`` when
    ``j <= p`` and, with a ``window``, ``p - j < window``."""
    query_pos = torch.arange(keys - queries, keys, device=device)[:, None]
    key_pos = torch.arange(keys, device=device)[None, :]
    allowed = key_pos <= query_pos
    return allowed if window is None else allowed & (query_pos - key_pos < window)


def window_binds(length: int, window: int | None) -> bool:
    """Whether a ``window`` hides any key from any query of a causal sequence of ``length``
    tokens (it does once the sequence is longer than the window)."""
    return window is not None and length > window


def scores_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention output ``[rows, heads, queries, value_dim]`` of ``query`` ``[rows, heads,
    queries, head_dim]`` over ``key`` ``[rows, kv_heads, keys, head_dim]`` and ``value``
    ``[rows, kv_heads, keys, value_dim]`` (grouped-query heads share their key/value head
    without copies).

    ``allowed``: boolean, True where a query sees a key, broadcastable to ``[rows, 1 or heads,
    queries, keys]``; None lets every query see every key. Scores are ``query . key * scale``
    (``head_dim ** -0.5`` by default), then ``softcap * tanh(score / softcap)`` when
    ``softcap`` is set, the softmax in float32 (float64 for float64 inputs) and cast back, as
    transformers' eager kernels do (in float32 always).
    Every query must see at least one key. ``dropout`` (a probability) applies to the weights."""
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.view(rows, kv_heads, groups, queries, dim)
    scores = torch.matmul(q, key[:, :, None].transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if allowed is not None:
        while allowed.dim() < 4:
            allowed = allowed[None]
        allowed = allowed.unflatten(1, (kv_heads, groups)) if allowed.shape[1] == heads > 1 else allowed[:, :, None]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    if dropout:
        weights = torch.nn.functional.dropout(weights, p=dropout)
    out = torch.matmul(weights, value[:, :, None])
    return out.view(rows, heads, queries, value.shape[-1])
