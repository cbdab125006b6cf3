"""Token logprobs and top-k logits from hidden states, chunked over the vocabulary; shared
by policy backends.

The language-model head is applied here rather than inside the model, one slice of the
vocabulary at a time, so no ``[tokens, vocab]`` float32 tensor ever exists whole: the
largest temporary is ``[tokens, chunk]``. The backward pass recomputes each chunk's logits
instead of keeping them, so training memory is bounded the same way.

Logits are computed in float32 (float64 when the inputs are float64, for checks) whatever
the model's compute dtype. Logprobs are those of ``logits / temperature`` (the sampler's
distribution, see :mod:`posttrain.backend.sampling`); each chunk of logits is divided as it is
computed, in that dtype, so temperature 1 leaves every value unchanged. Top-k logits are
raw (unscaled) logits.

Final-logit soft-capping (Gemma 2's ``final_logit_softcapping``): with ``softcap`` set, the
logits are ``softcap * tanh(hidden @ weight.T / softcap)``, as the model's own head computes
them, before any temperature; every function here takes it, top-k logits included.

Vocabulary parallel: with a :class:`VocabShard`, ``weight`` holds only this rank's rows of
the output embedding (tensor parallelism splits the vocabulary over ``shard.group``). The
log-sum-exp and the target logits are combined over the group, so every rank returns the
same full-vocabulary logprobs; the gradient of ``hidden`` is this rank's share only, and
the caller sums it over the group (megatron-core's tensor-parallel region functions do).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
import torch.distributed as dist

from posttrain.backend.exact import pad_rows


@attrs.frozen
class VocabShard:
    """This rank holds rows ``start .. start + weight.shape[0] - 1`` of the output embedding;
    the other rows are on the other ranks of ``group``."""

    group: dist.ProcessGroup
    start: int


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _logits(h: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``h @ weight.T`` in ``h``'s dtype, soft-capped when ``softcap`` is set."""
    logits = h @ weight.to(h.dtype).T
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _chunks(vocab: int, chunk_size: int) -> range:
    if chunk_size <= 0:
        raise ValueError(f"logprob chunk size must be positive, got {chunk_size}")
    return range(0, vocab, chunk_size)


def _group_logsumexp(lse: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``log(sum over ranks of exp(lse))``, stable (ranks without rows pass -inf)."""
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = torch.exp(lse - peak)
    dist.all_reduce(total, group=group)
    return peak + torch.log(total)


def _local_logsumexp(
    h: torch.Tensor, weight: torch.Tensor, chunk_size: int, temperature: float, softcap: float | None
) -> torch.Tensor:
    """``logsumexp(logits / temperature)`` per row over this rank's rows of ``weight``, one
    chunk at a time (-inf for a rank without rows); ``h`` already in the compute dtype."""
    return _combined([torch.logsumexp(logits, dim=-1) for _, logits in _scaled_chunks(h, weight, chunk_size, temperature, softcap)], h)


def _combined(parts: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp over chunks of their per-row log-sum-exps ``parts`` (-inf per row of
    ``h`` when there are none). Reduced along a contiguous last dimension, which gives a row
    the same bits whatever the number of rows; reduced across rows' columns (``stack`` on
    dim 0), CPU kernels change the order with the row count."""
    return torch.logsumexp(torch.stack(parts, dim=-1), dim=-1) if parts else h.new_full(h.shape[:1], float("-inf"))


@torch.no_grad()
def logsumexp_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int,
    temperature: float = 1.0,
    shard: VocabShard | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``log sum_v exp(logit_v / temperature)`` per row (``logit_v = hidden @ weight[v]``,
    soft-capped with ``softcap``), the normaliser of the logprobs at that temperature ([N]
    from ``hidden`` [N, H]; over the whole vocabulary of the group with ``shard``), one
    vocabulary chunk at a time; no gradient. ``logit / temperature - logsumexp_logits(...)``
    is the logprob :func:`target_logprobs` gives."""
    dtype = _compute_dtype(hidden, weight)
    lse = _local_logsumexp(hidden.to(dtype), weight, chunk_size, temperature, softcap)
    return lse if shard is None else _group_logsumexp(lse, shard.group)


class _ChunkedTargetLogprob(torch.autograd.Function):
    """``log_softmax(logits / temperature)[i, targets[i]]`` for every row ``i`` (``targets``
    [N]), or ``[i, targets[i, j]]`` for every row and column (``targets`` [N, K]); ``logits =
    hidden @ weight.T``, soft-capped with ``softcap``. The cap's derivative, ``1 -
    tanh(z / softcap) ** 2`` at raw logit ``z``, scales each logit's gradient.

    Both passes walk the vocabulary one chunk at a time: a target's logit is read from its
    chunk's logits, and the backward writes each chunk's rows of the weight's gradient in the
    weight's dtype, so no temporary exceeds ``[N, chunk]`` (``[N, K]`` for the targets) and
    none is ``[N, K, hidden]`` or ``[vocabulary, hidden]`` in float32."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        temperature: float,
        shard: VocabShard | None,
        softcap: float | None,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden, weight)
        h = hidden.to(dtype)
        one = targets.dim() == 1  # one target per row: [N], else [N, K]
        local = (targets[:, None] if one else targets) - (shard.start if shard is not None else 0)
        parts = []
        target_logits = h.new_zeros(local.shape)  # stays 0 for targets on other ranks' rows
        for v0, logits in _scaled_chunks(h, weight, chunk_size, temperature, softcap):
            parts.append(torch.logsumexp(logits, dim=-1))
            inside, column = _in_chunk(local, v0, logits.shape[1])
            target_logits = torch.where(inside, logits.gather(1, column), target_logits)
        lse = _combined(parts, h)
        if shard is not None:
            lse = _group_logsumexp(lse, shard.group)
            dist.all_reduce(target_logits, group=shard.group)
        ctx.save_for_backward(hidden, weight, local, lse)
        ctx.chunk_size, ctx.temperature, ctx.softcap, ctx.one = chunk_size, temperature, softcap, one
        out = target_logits - lse[:, None]
        return out[:, 0] if one else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, local, lse = ctx.saved_tensors
        chunk_size, temperature, softcap = ctx.chunk_size, ctx.temperature, ctx.softcap
        dtype = lse.dtype
        h = hidden.to(dtype)
        # d(logprob)/d(logits / T) = onehot - softmax; 1/T then carries it to the logits, and
        # the soft-cap's slope to the raw logits.
        g = grad_out.to(dtype)
        g = g[:, None] if ctx.one else g  # [N, K]: one column per target
        g_total = g.sum(-1)  # every target's softmax term has the same shape
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for v0, logits in _scaled_chunks(h, weight, chunk_size, temperature, softcap):
            slope = None if softcap is None else 1 - (logits * (temperature / softcap)) ** 2
            inside, column = _in_chunk(local, v0, logits.shape[1])
            # in place, one [N, chunk] buffer: the logits become their gradient
            grad_logits = logits.sub_(lse[:, None]).exp_().mul_(-g_total[:, None])
            grad_logits.scatter_add_(1, column, torch.where(inside, g, 0.0)).div_(temperature)
            if slope is not None:
                grad_logits.mul_(slope)
            w = weight[v0:v0 + chunk_size].to(dtype)
            if need_h:
                grad_h.addmm_(grad_logits, w)
            if need_w:
                grad_w[v0:v0 + chunk_size] = grad_logits.T @ h
        return grad_h.to(hidden.dtype) if need_h else None, grad_w, None, None, None, None, None


def _scaled_chunks(
    h: torch.Tensor, weight: torch.Tensor, chunk_size: int, temperature: float, softcap: float | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(v0, logits / temperature)`` of each chunk of ``weight``'s rows, ``[N, chunk]`` in
    ``h``'s dtype (soft-capped with ``softcap`` before the division)."""
    for v0 in _chunks(weight.shape[0], chunk_size):
        yield v0, _logits(h, weight[v0:v0 + chunk_size], softcap).div_(temperature)


def _in_chunk(local: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the row ids ``local`` [N, K] fall in the chunk of ``width`` rows from ``v0``,
    and their columns in it (0 for the others, which the caller masks)."""
    column = local - v0
    inside = (column >= 0) & (column < width)
    return inside, torch.where(inside, column, 0)


def target_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    temperature: float = 1.0,
    shard: VocabShard | None = None,
    softcap: float | None = None,
    min_rows: int = 0,
) -> torch.Tensor:
    """Logprob of ``targets[i]`` under ``softmax(logits[i] / temperature)``, ``logits =
    hidden @ weight.T`` (``softcap * tanh(hidden @ weight.T / softcap)`` with ``softcap``).

    ``hidden`` [N, H], ``weight`` [V, H] (the output embedding, or this rank's rows of it
    with ``shard``), ``targets`` int64 [N] (full-vocabulary ids), or [N, K] for K ids per row
    (e.g. a teacher's top-k tokens), ``temperature`` > 0, ``softcap`` > 0 or None. Returns the
    shape of ``targets`` in float32 (or float64 for float64 inputs), differentiable in
    ``hidden`` and ``weight``. With fewer than ``min_rows`` rows, zero rows are appended for
    the computation (so its matrix products take the kernels of larger ones: exact logprobs,
    :mod:`posttrain.backend.exact`) and dropped from the result.
    """
    if not temperature > 0:
        raise ValueError(f"logprob temperature must be > 0, got {temperature}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"logit soft-cap must be > 0 or None, got {softcap}")
    rows = hidden.shape[0]
    if rows < min_rows:
        hidden, targets = pad_rows(hidden, min_rows), pad_rows(targets, min_rows)
    out = _ChunkedTargetLogprob.apply(hidden, weight, targets, chunk_size, temperature, shard, softcap)
    return out[:rows]


def sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    predicted: torch.Tensor,
    chunk_size: int,
    temperature: float = 1.0,
    shard: VocabShard | None = None,
    softcap: float | None = None,
    min_rows: int = 0,
) -> torch.Tensor:
    """Per-position logprobs of rows of tokens (logits soft-capped with ``softcap``; the head
    on at least ``min_rows`` rows, see :func:`target_logprobs`).

    ``hidden`` [R, T, H] are the final hidden states of ``input_ids`` [R, T]; ``predicted``
    bool [R, T] is True where token ``t`` is predicted from position ``t - 1`` of the same
    sequence (never at ``t = 0``). Returns [R, T] with ``log p(input_ids[:, t] | ...)``,
    ``p = softmax(logits / temperature)``, where ``predicted`` is True and 0 elsewhere;
    only those positions go through the head. ``input_ids`` may be [R, T, K] instead: K
    token ids per position, whose logprobs at that position are returned, [R, T, K].
    """
    src = predicted[:, 1:]
    values = target_logprobs(
        hidden[:, :-1][src], weight, input_ids[:, 1:][src], chunk_size, temperature, shard, softcap, min_rows
    )
    if values.dim() == 1:
        shifted = values.new_zeros(src.shape).masked_scatter(src, values)
        return torch.nn.functional.pad(shifted, (1, 0))
    shifted = values.new_zeros((*src.shape, values.shape[1])).masked_scatter(src[..., None], values)
    return torch.nn.functional.pad(shifted, (0, 0, 1, 0))


@torch.no_grad()
def topk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    chunk_size: int,
    shard: VocabShard | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest raw logits of ``hidden @ weight.T`` per row (soft-capped with
    ``softcap``, not divided by any temperature) and their vocabulary ids.

    ``hidden`` [N, H], ``weight`` [V, H] (this rank's rows with ``shard``); returns float32
    values [N, k] (descending) and int64 indices [N, k] (full-vocabulary ids, the same on
    every rank of the group). Each vocabulary chunk's top-k is merged into a running top-k.
    """
    vocab = weight.shape[0]
    if shard is not None:
        sizes = torch.tensor([vocab], device=weight.device)
        dist.all_reduce(sizes, group=shard.group)
        vocab = int(sizes)
    if not 0 < k <= vocab:
        raise ValueError(f"top-k needs 0 < k <= vocabulary size {vocab}, got k={k}")
    dtype = _compute_dtype(hidden, weight)
    h = hidden.to(dtype)
    best_vals = h.new_empty((h.shape[0], 0))
    best_idx = torch.empty((h.shape[0], 0), dtype=torch.long, device=h.device)
    start = shard.start if shard is not None else 0
    for v0 in _chunks(weight.shape[0], chunk_size):
        logits = _logits(h, weight[v0:v0 + chunk_size], softcap)
        vals, idx = logits.topk(min(k, logits.shape[1]), dim=-1)
        best_vals, best_idx = _merge_topk(best_vals, best_idx, vals, idx + start + v0, k)
    if shard is None:
        return best_vals, best_idx
    # every rank's top-k (padded to k with -inf), merged into the top-k of the whole vocabulary
    missing = k - best_vals.shape[1]
    best_vals = torch.nn.functional.pad(best_vals, (0, missing), value=float("-inf"))
    best_idx = torch.nn.functional.pad(best_idx, (0, missing), value=-1)
    world = dist.get_world_size(shard.group)
    all_vals = [torch.empty_like(best_vals) for _ in range(world)]
    all_idx = [torch.empty_like(best_idx) for _ in range(world)]
    dist.all_gather(all_vals, best_vals, group=shard.group)
    dist.all_gather(all_idx, best_idx, group=shard.group)
    return _merge_topk(h.new_empty((h.shape[0], 0)), best_idx[:, :0], torch.cat(all_vals, -1), torch.cat(all_idx, -1), k)


def _merge_topk(
    best_vals: torch.Tensor, best_idx: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    merged_vals = torch.cat([best_vals, vals], dim=-1)
    merged_idx = torch.cat([best_idx, idx], dim=-1)
    top_vals, pos = merged_vals.topk(min(k, merged_vals.shape[1]), dim=-1)
    return top_vals, merged_idx.gather(-1, pos)


def loss_positions(lengths: torch.Tensor, width: int, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool [B, width]: positions whose logprob is reported (1 <= t < length, and
    ``token_mask`` where given)."""
    t = torch.arange(width)
    keep = (t[None, :] >= 1) & (t[None, :] < lengths[:, None])
    return keep & token_mask.bool() if token_mask is not None else keep
