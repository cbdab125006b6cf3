"""From a microbatch of right-padded samples to model inputs, and from the last stage's
hidden states to per-sample logprobs and top-k logits.

Layout. A microbatch runs as ``[b, T]`` token rows, ``T`` the longest sample rounded up so
the sequence splits evenly (over ``2 * context_parallel_size`` chunks, and over the
tensor-parallel ranks with sequence parallelism). Attention is causal, so right padding
never changes a real token. Every position ``t`` carries the *next* token as its label:
the hidden state at ``t`` scores ``x[t + 1]``.

Context parallel: each context-parallel rank holds chunks ``r`` and ``2 * cp - 1 - r`` of
the ``2 * cp`` equal chunks of the sequence (megatron-core's load-balanced causal layout,
:func:`cp_positions`); its next-token logprobs are gathered over the group
(:func:`gather_context_parallel`) so every rank holds the whole rows.

Vocabulary: the output layer's rows are split over the tensor-parallel ranks (and padded);
only the real vocabulary rows enter the softmax (:func:`vocab_slice`).
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from posttrain.backend.logprobs import VocabShard, loss_positions, target_logprobs, topk_logits
from posttrain.batch import Batch


@attrs.frozen
class Rows:
    """Model inputs of one microbatch on this context-parallel rank, and the way back.

    ``input_ids``, ``labels`` [b, T_local]: tokens and next tokens at this rank's positions;
    ``scored`` [b, T_local]: True where the label is a real token (``t + 1 < length``);
    ``positions`` [T_local]: this rank's positions in the full row of ``width`` ``T``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    scored: torch.Tensor
    positions: torch.Tensor
    width: int

    def to(self, device: torch.device) -> Rows:
        return attrs.evolve(self, input_ids=self.input_ids.to(device), labels=self.labels.to(device),
                            scored=self.scored.to(device))


def cp_positions(width: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions (of ``width``, divisible by ``2 * cp_size``) that context-parallel
    rank ``cp_rank`` holds: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``."""
    chunk = width // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def row_multiple(tp_size: int, cp_size: int, sequence_parallel: bool) -> int:
    """What the row length must be a multiple of for the parallel layout."""
    return math.lcm(2 * cp_size if cp_size > 1 else 1, tp_size if sequence_parallel else 1)


def make_rows(input_ids: torch.Tensor, lengths: torch.Tensor, multiple: int, cp_size: int, cp_rank: int) -> Rows:
    """:class:`Rows` of right-padded samples ``input_ids`` [b, S] with ``lengths`` [b]."""
    width = -(-int(lengths.max()) // multiple) * multiple
    ids = torch.nn.functional.pad(input_ids[:, :width], (0, max(0, width - input_ids.shape[1])))
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    scored = torch.arange(width)[None, :] + 1 < lengths[:, None]
    positions = cp_positions(width, cp_size, cp_rank) if cp_size > 1 else torch.arange(width)
    return Rows(ids[:, positions], labels[:, positions], scored[:, positions], positions, width)


class _GatherContextParallel(torch.autograd.Function):
    """Forward: every rank's ``[b, T_local, ...]`` values placed into ``[b, T, ...]`` rows.
    Backward: this rank's positions of the gradient (each rank computes the same loss on the
    whole rows, so nothing is summed)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, positions: torch.Tensor, width: int, group: dist.ProcessGroup):
        size = dist.get_world_size(group)
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        full = local.new_zeros((local.shape[0], width, *local.shape[2:]))
        for rank, piece in enumerate(pieces):
            full[:, cp_positions(width, size, rank).to(local.device)] = piece
        ctx.save_for_backward(positions)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return grad[:, positions.to(grad.device)], None, None, None


def gather_context_parallel(local: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``[b, T_local, ...]`` values at this rank's positions -> ``[b, T, ...]`` in order."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return local
    return _GatherContextParallel.apply(local, rows.positions, rows.width, parallel_state.get_context_parallel_group())


def full_hidden(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """The last stage's ``[s, b, h]`` hidden states as ``[b, s, h]`` on every
    tensor-parallel rank; in backward, the ranks' gradient shares are summed (each rank's
    share covers its vocabulary rows)."""
    if sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True).transpose(0, 1)
    hidden = hidden.transpose(0, 1)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        # after the transpose: megatron-core all-reduces the gradient in place, which only
        # reaches autograd when that gradient is contiguous (a transposed one is not)
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    return hidden


def vocab_slice(weight: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, VocabShard | None]:
    """This rank's real vocabulary rows of the (padded, tensor-parallel) output weight, and
    where they start (None without tensor parallelism)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    rows = weight[: max(0, min(weight.shape[0], vocab_size - start))]
    if tp == 1:
        return rows, None
    return rows, VocabShard(parallel_state.get_tensor_model_parallel_group(), start)


def sample_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: Rows,
    batch: Batch,
    *,
    vocab_size: int,
    chunk_size: int,
    temperature: float,
    sequence_parallel: bool,
) -> torch.Tensor:
    """Logprobs [b, S] of the microbatch ``batch`` (``input_ids`` [b, S]) in the policy
    convention (``[:, t] = log p(x_t | x_<t)``, 0 at t = 0, on padding and where
    ``token_mask`` is 0), differentiable in ``hidden`` and ``weight``."""
    h = full_hidden(hidden, sequence_parallel)
    w, shard = vocab_slice(weight, vocab_size)
    scored = rows.scored  # only the reported positions go through the head: a prompt costs no head work
    if "token_mask" in batch:
        next_masked = batch["token_mask"][:, 1:].bool()  # [:, t]: the token t + 1 is reported
        next_masked = torch.nn.functional.pad(next_masked, (0, max(0, rows.width - next_masked.shape[1])))
        scored = scored & next_masked[:, :rows.width][:, rows.positions].to(scored.device)
    values = target_logprobs(h[scored], w, rows.labels[scored], chunk_size, temperature, shard)
    local = values.new_zeros(scored.shape).masked_scatter(scored, values)
    next_token = gather_context_parallel(local, rows)
    width = batch["input_ids"].shape[1]
    logprobs = torch.nn.functional.pad(next_token, (1, max(0, width - rows.width - 1)))[:, :width]
    keep = loss_positions(batch["input_lengths"], width, batch["token_mask"] if "token_mask" in batch else None)
    return torch.where(keep.to(logprobs.device), logprobs, 0.0)


@torch.no_grad()
def sample_topk(
    hidden: torch.Tensor, weight: torch.Tensor, rows: Rows, lengths: torch.Tensor, k: int, width: int, *,
    vocab_size: int, chunk_size: int, sequence_parallel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` raw logits and ids [b, width - 1, k] of the next token at every real
    position (0 elsewhere)."""
    h = full_hidden(hidden, sequence_parallel)
    w, shard = vocab_slice(weight, vocab_size)
    real = (rows.positions[None, :] < lengths[:, None]).to(h.device)
    vals, ids = topk_logits(h[real], w, k, chunk_size, shard)
    local_vals = vals.new_zeros((*real.shape, k))
    local_ids = ids.new_zeros((*real.shape, k))
    local_vals[real], local_ids[real] = vals, ids
    full_vals, full_ids = gather_context_parallel(local_vals, rows), gather_context_parallel(local_ids, rows)
    pad = (0, 0, 0, max(0, width - rows.width))
    return (torch.nn.functional.pad(full_vals, pad)[:, : width - 1].float(),
            torch.nn.functional.pad(full_ids, pad)[:, : width - 1])
