"""Token logprobs and top-k logits from hidden states, chunked over the vocabulary.

The language-model head is applied here rather than inside the model, one slice of the
vocabulary at a time, so no ``[tokens, vocab]`` float32 tensor ever exists whole: the
largest temporary is ``[tokens, chunk]``. The backward pass recomputes each chunk's logits
instead of keeping them, so training memory is bounded the same way.

Logits are computed in float32 (float64 when the inputs are float64, for checks) whatever
the model's compute dtype.
"""

from __future__ import annotations

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _chunks(vocab: int, chunk_size: int) -> range:
    if chunk_size <= 0:
        raise ValueError(f"logprob chunk size must be positive, got {chunk_size}")
    return range(0, vocab, chunk_size)


class _ChunkedTargetLogprob(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[i, targets[i]]`` for every row ``i``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(hidden, weight)
        h = hidden.to(dtype)
        lse_parts = [
            torch.logsumexp(h @ weight[v0:v0 + chunk_size].to(dtype).T, dim=-1)
            for v0 in _chunks(weight.shape[0], chunk_size)
        ]
        lse = torch.logsumexp(torch.stack(lse_parts), dim=0)
        target_logits = (h * weight[targets].to(dtype)).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        return target_logits - lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        dtype = lse.dtype
        h = hidden.to(dtype)
        g = grad_out.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = g[:, None] * weight[targets].to(dtype) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        if need_w:
            grad_w.index_add_(0, targets, g[:, None] * h)
        for v0 in _chunks(weight.shape[0], chunk_size):
            w = weight[v0:v0 + chunk_size].to(dtype)
            # d(target_logit - lse)/d logits = onehot - softmax; the onehot part is added above.
            grad_logits = -g[:, None] * torch.exp(h @ w.T - lse[:, None])
            if need_h:
                grad_h += grad_logits @ w
            if need_w:
                grad_w[v0:v0 + chunk_size] += grad_logits.T @ h
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            None,
        )


def target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Logprob of ``targets[i]`` under ``softmax(hidden[i] @ weight.T)``.

    ``hidden`` [N, H], ``weight`` [V, H] (the output embedding), ``targets`` int64 [N].
    Returns [N] in float32 (or float64 for float64 inputs), differentiable in ``hidden``
    and ``weight``.
    """
    return _ChunkedTargetLogprob.apply(hidden, weight, targets, chunk_size)


def sequence_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, predicted: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Per-position logprobs of rows of tokens.

    ``hidden`` [R, T, H] are the final hidden states of ``input_ids`` [R, T]; ``predicted``
    bool [R, T] is True where token ``t`` is predicted from position ``t - 1`` of the same
    sequence (never at ``t = 0``). Returns [R, T] with ``log p(input_ids[:, t] | ...)``
    where ``predicted`` is True and 0 elsewhere; only those positions go through the head.
    """
    src = predicted[:, 1:]
    values = target_logprobs(hidden[:, :-1][src], weight, input_ids[:, 1:][src], chunk_size)
    shifted = values.new_zeros(src.shape).masked_scatter(src, values)
    return torch.nn.functional.pad(shifted, (1, 0))


@torch.no_grad()
def topk_logits(hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of ``hidden @ weight.T`` per row and their vocabulary ids.

    ``hidden`` [N, H], ``weight`` [V, H]; returns float32 values [N, k] (descending) and
    int64 indices [N, k]. Each vocabulary chunk's top-k is merged into a running top-k.
    """
    vocab = weight.shape[0]
    if not 0 < k <= vocab:
        raise ValueError(f"top-k needs 0 < k <= vocabulary size {vocab}, got k={k}")
    dtype = _compute_dtype(hidden, weight)
    h = hidden.to(dtype)
    best_vals = h.new_empty((h.shape[0], 0))
    best_idx = torch.empty((h.shape[0], 0), dtype=torch.long, device=h.device)
    for v0 in _chunks(vocab, chunk_size):
        logits = h @ weight[v0:v0 + chunk_size].to(dtype).T
        vals, idx = logits.topk(min(k, logits.shape[1]), dim=-1)
        merged_vals = torch.cat([best_vals, vals], dim=-1)
        merged_idx = torch.cat([best_idx, idx + v0], dim=-1)
        best_vals, pos = merged_vals.topk(min(k, merged_vals.shape[1]), dim=-1)
        best_idx = merged_idx.gather(-1, pos)
    return best_vals, best_idx
