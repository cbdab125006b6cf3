"""Causal attention inside the segments of packed rows, segments of similar length batched.

A packed row holds several samples end to end, and attention must stay inside each
sample. A 4-D block-diagonal mask gets that right, but the kernel still scores every query
of the row against every key (CPU kernels do not skip masked blocks): ``(sum n)^2`` work
per row instead of ``sum n^2``. On the benchmark's SFT step (16 samples, 1112 tokens)
attention took a fifth of the step that way.

:data:`SEGMENT_SDPA` names :func:`segment_sdpa` in transformers' ``AttentionInterface``.
A model loaded with it gets no mask from Hugging Face (the name has no mask builder, so
``create_causal_mask`` returns ``None``); it needs none:

- with ``cu_seq_lens_q`` (segment bounds over the flattened ``[rows x width]`` tokens, as
  flash-attention's variable-length kernels take them, passed through the model's
  keyword arguments), each segment attends causally to itself alone;
- without, every row is one causal sequence, which is exact for the right-padded rows the
  dtensor worker builds (a real token never sees the padding after it).

A layer's ``sliding_window`` and ``softcap`` keywords (transformers passes them to every
attention function: Mistral's, Gemma's and Qwen2's windows, Gemma 2's attention logit
soft-cap) are honoured: a window that binds (a sequence longer than it) runs as SDPA under a
banded causal mask; a soft-cap, which SDPA cannot apply, as explicit scores
(:func:`posttrain.backend.attention.scores_attention`). Without either, and where a window
does not bind, a sequence runs as SDPA's plain causal kernel.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from posttrain.backend.attention import scores_attention, window_binds, window_mask

SEGMENT_SDPA = "posttrain_segment_sdpa"
#: :func:`exact_segment_sdpa`'s name: segment attention for exact logprobs.
EXACT_SEGMENT_SDPA = "posttrain_exact_segment_sdpa"


#: Segments whose lengths are within this factor of a bucket's shortest share one SDPA call.
BUCKET_SPREAD = 1.5


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    spread: float = BUCKET_SPREAD,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Attention output ``[rows, width, heads, value_dim]`` of ``query`` ``[rows, heads,
    width, head_dim]`` over ``key`` ``[rows, kv_heads, width, head_dim]`` and ``value``
    ``[rows, kv_heads, width, value_dim]`` (grouped-query heads are shared, not copied).

    Segments of similar length (within ``spread`` times a bucket's shortest) are gathered into one right-padded
    batch, run as one causal call and their real tokens copied back: a few kernel calls per
    layer however many samples a row holds (a call costs about a millisecond on CPU). Tokens
    are gathered and placed whole (all heads at once, ``index_select`` / ``index_copy``,
    whose backwards are one scatter-add and one gather); Hugging Face's projections leave
    queries, keys and values token-major in memory, so no layout copy comes first. Padding
    repeats a segment's last token; causality keeps it out of every real token's view.
    Outputs at a row's padding tail are computed like any segment's and mean nothing.

    ``sliding_window``: a query sees itself and the ``sliding_window - 1`` tokens before it;
    ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax."""
    if attention_mask is not None:
        raise ValueError(f"{SEGMENT_SDPA} takes segment bounds (cu_seq_lens_q), not an attention mask")

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        length = q.shape[2]
        if softcap is not None:
            allowed = window_mask(length, length, sliding_window, q.device)
            return scores_attention(q, k, v, allowed, scale=scaling, softcap=softcap, dropout=dropout)
        banded = window_binds(length, sliding_window)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=window_mask(length, length, sliding_window, q.device) if banded else None,
            dropout_p=dropout, is_causal=not banded, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )

    if cu_seq_lens_q is None:
        return causal(query, key, value).transpose(1, 2).contiguous(), None
    rows, heads, width, _ = query.shape
    value_dim = value.shape[-1]  # multi-head latent attention's values are narrower than its queries and keys

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [rows, h, width, d] -> [rows * width, h, d]
        return x.transpose(1, 2).reshape(rows * width, x.shape[1], x.shape[-1])

    q, k, v = tokens(query), tokens(key), tokens(value)
    outputs, places = [], []
    for bucket in segment_plan(cu_seq_lens_q, rows, width, spread, q.device):
        count, longest, index, real = bucket.count, bucket.longest, bucket.index, bucket.real
        batch = [x.index_select(0, index).view(count, longest, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
        output = causal(*batch).transpose(1, 2).reshape(count * longest, heads, value_dim)
        outputs.append(output.index_select(0, real))
        places.append(index[real])
    out = q.new_zeros(rows * width, heads, value_dim).index_copy(0, torch.cat(places), torch.cat(outputs))
    return out.view(rows, width, heads, value_dim), None


@attrs.frozen
class Bucket:
    """Segments run as one padded batch: ``count`` segments of at most ``longest`` tokens;
    ``index`` [count * longest] the flattened token each padded position takes (a segment's
    last one past its end), ``real`` the padded positions of real tokens; both on the device."""

    count: int
    longest: int
    index: torch.Tensor
    real: torch.Tensor


#: The last plan made: (the bounds it was made for, their spread, its buckets). Every layer of
#: a forward pass, and the recomputation of checkpointed layers in its backward, reads the same
#: bounds; reading them (``tolist``) waits for the device, once per pass rather than per layer.
_last_plan: tuple[weakref.ref[torch.Tensor], float, list[Bucket]] | None = None


def segment_plan(cu_seq_lens_q: torch.Tensor, rows: int, width: int, spread: float,
                 device: torch.device) -> list[Bucket]:
    """The buckets (:func:`_buckets`) of the segments ``cu_seq_lens_q`` bounds, checked and
    laid out on ``device``; made once for a bounds tensor and spread, then reused."""
    global _last_plan
    if _last_plan is not None and _last_plan[0]() is cu_seq_lens_q and _last_plan[1] == spread:
        return _last_plan[2]
    bounds = cu_seq_lens_q.tolist()
    _check_bounds(bounds, rows, width)
    plan = []
    for starts, lengths in _buckets(bounds, spread):
        longest = int(lengths.max())
        steps = torch.arange(longest)
        index = (starts[:, None] + torch.minimum(steps[None, :], lengths[:, None] - 1)).flatten()
        real = (steps[None, :] < lengths[:, None]).flatten().nonzero()[:, 0]
        plan.append(Bucket(len(starts), longest, index.to(device), real.to(device)))
    _last_plan = (weakref.ref(cu_seq_lens_q), spread, plan)
    return plan


def _check_bounds(bounds: list[int], rows: int, width: int) -> None:
    """Bounds run from 0 to ``rows * width``; every segment is non-empty and within one row."""
    if bounds[0] != 0 or bounds[-1] != rows * width:
        raise ValueError(f"cu_seq_lens_q must run from 0 to rows x width = {rows * width}, got {bounds}")
    for start, end in zip(bounds, bounds[1:], strict=False):
        if end <= start or start // width != (end - 1) // width:
            raise ValueError(f"segment [{start}, {end}) of cu_seq_lens_q is empty or crosses the end of row {start // width}")


def exact_segment_sdpa(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`segment_sdpa` with only segments of one length sharing a call: each runs as the
    causal attention of a sequence of exactly its length, the arithmetic of exact logprobs
    (:mod:`posttrain.backend.exact`; a right-padded bucket would change its bits)."""
    return segment_sdpa(*args, spread=1.0, **kwargs)


def _buckets(bounds: list[int], spread: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Segments grouped by length, shortest first: ``(starts, lengths)`` per bucket, where a
    bucket's longest segment is at most ``spread`` times its shortest."""
    segments = sorted(zip((b - a for a, b in zip(bounds, bounds[1:], strict=False)), bounds, strict=False))
    buckets: list[list[tuple[int, int]]] = []
    for length, start in segments:
        if not buckets or length > spread * buckets[-1][0][0]:
            buckets.append([])
        buckets[-1].append((length, start))
    return [(torch.tensor([s for _, s in b]), torch.tensor([n for n, _ in b])) for b in buckets]


AttentionInterface.register(SEGMENT_SDPA, segment_sdpa)
AttentionInterface.register(EXACT_SEGMENT_SDPA, exact_segment_sdpa)
