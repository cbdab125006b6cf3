"""One gradient tensor for tied input and output embeddings on one rank.

When a model's input embedding and output head share one weight, autograd gets two
``[vocabulary, hidden]`` gradients for it in every backward pass: the head's (dense: every
vocabulary row has one) and the embedding lookup's (zero but for the rows of the batch's
tokens, made dense all the same), and adds them (torch 2.13: into a third tensor). At a
151,936-token vocabulary and hidden 1024 each is 622 MB, made at the end of the backward
pass, when the other gradients are all there: they set the step's peak memory.

:func:`tie_gradients` makes the embedding's backward add its rows into the head's gradient
in place instead (``index_add_``), and hand autograd nothing for the weight. The sum is the
same, added in another order. It applies to a plain ``torch.nn.Embedding`` whose weight is a
trained, unsharded parameter shared with the output embedding: one rank, no FSDP. The head's
gradient is taken on its way to autograd by :class:`_HeadWeight`, an identity on the weight
the head reads.

Only a graph with one lookup and one head pass does this: there autograd holds the head's
gradient untouched until the lookup's backward has run. With more (two forwards before one
backward), autograd may add the head's gradient to another before the lookup's rows are in
it, so such graphs, counted as their forwards run, take the dense gradient as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TiedGradient:
    """The link between one tied embedding's lookup and the head passes that read its weight
    (:func:`tie_gradients`); ``head_weight`` is the weight a head pass reads."""

    def __init__(self, embedding: nn.Embedding):
        self.embedding = embedding
        self.pending: torch.Tensor | None = None  # the head's gradient, until the lookup's backward
        # lookups and head passes recorded for a backward since the last lookup's backward
        self.lookups = self.heads = 0

    def one_of_each(self) -> bool:
        return self.lookups == 1 and self.heads == 1

    def head_weight(self) -> torch.Tensor:
        self.heads += self._recorded()
        return _HeadWeight.apply(self.embedding.weight, self)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.lookups += self._recorded()
        return _Lookup.apply(input_ids, self.embedding.weight, self)

    def _recorded(self) -> bool:
        """Whether a call now is recorded for a backward pass to the weight."""
        return torch.is_grad_enabled() and self.embedding.weight.requires_grad


class _HeadWeight(torch.autograd.Function):
    """The weight itself; its backward keeps the head's gradient for the lookup's backward to
    add into, in a graph of one lookup and one head pass (:meth:`TiedGradient.one_of_each`)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tied: TiedGradient) -> torch.Tensor:
        ctx.tied = tied
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tied = ctx.tied
        tied.pending = grad if tied.one_of_each() and grad.is_contiguous() else None
        return grad, None


class _Lookup(torch.autograd.Function):
    """``F.embedding(input_ids, weight, padding_idx)``; the backward adds each token's
    gradient to its row of the head's gradient when there is one (and returns none for the
    weight), else returns the dense gradient ``F.embedding``'s backward gives. The padding
    row gets no gradient, as with ``F.embedding``."""

    @staticmethod
    def forward(ctx: Any, input_ids: torch.Tensor, weight: torch.Tensor, tied: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(input_ids)
        ctx.tied, ctx.weight_shape = tied, weight.shape
        return F.embedding(input_ids, weight, tied.embedding.padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        (input_ids,) = ctx.saved_tensors
        tied = ctx.tied
        pending, tied.pending = tied.pending, None  # autograd may now take it as .grad
        tied.lookups = tied.heads = 0
        if not ctx.needs_input_grad[1]:
            return None, None, None
        rows, grads = input_ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if tied.embedding.padding_idx is not None:
            keep = rows != tied.embedding.padding_idx
            rows, grads = rows[keep], grads[keep]
        if pending is not None:
            pending.index_add_(0, rows, grads)
            return None, None, None
        dense = grads.new_zeros(ctx.weight_shape)
        return None, dense.index_add_(0, rows, grads), None


def tie_gradients(lm: nn.Module) -> TiedGradient | None:
    """Route ``lm``'s input embedding through a :class:`TiedGradient` when it can serve
    (a plain ``torch.nn.Embedding`` without ``max_norm``, frequency scaling or sparse
    gradients, whose trained weight is the output embedding's, not a DTensor); None, and
    ``lm`` unchanged, otherwise. The caller reads the head's weight from ``head_weight``."""
    embedding, output = lm.get_input_embeddings(), lm.get_output_embeddings()
    if (type(embedding) is not nn.Embedding or output is None or output.weight is not embedding.weight
            or not embedding.weight.requires_grad or embedding.max_norm is not None
            or embedding.scale_grad_by_freq or embedding.sparse
            or isinstance(embedding.weight, torch.distributed.tensor.DTensor)):
        return None
    tied = TiedGradient(embedding)
    embedding.forward = tied.lookup
    return tied
