"""Exact logprobs (``generation.exact_logprobs``): how a generation engine and a policy
backend lay out the forward passes that score sampled tokens, so that both get the same bits.

What fixes the bits of a token's logprob on a CPU (float32, torch 2.13, measured):

- a matrix product gives a row the same bits whatever the other rows, once it has at least
  12 rows (products of fewer rows take other kernels, decoding's one-row steps among them);
- so does a reduction along a contiguous last dimension; one across rows (along dim 0 of a
  ``[k, rows]`` tensor) changes its order with the row count, so the logprob head combines its
  vocabulary chunks along the last dimension;
- causal SDPA gives a position bits that depend on the length of the sequence it runs over
  (the kernel blocks by length) but not on the other sequences of the batch;
- the rest of a decoder works token by token (norms, rotary embeddings, activations), except
  the experts of a mixture of experts: transformers' default runs each expert on the tokens
  routed to it, a product whose rows depend on the batch; :data:`EXPERTS_IMPLEMENTATION` runs
  every token through its experts alone.

So a token's logprob is fixed by the sequence its forward runs over. The contract both sides
keep: the tokens of an assistant turn (a run of generated tokens, :func:`generated_spans`)
are scored by a causal forward over the sample's tokens up to the turn's last token (its
*scoring prefix*), with no other token in its attention (other prefixes of the same length
may share the kernel call); every forward has at least :data:`MIN_ROWS` tokens, and the
logprob head (:func:`~posttrain.backend.logprobs.target_logprobs`) at least :data:`MIN_ROWS`
rows; chunk size, temperature and soft-cap are the policy's. A generation engine scores a
turn right after sampling it, with the weights that sampled it (its prompt and completion are
the turn's scoring prefix); a policy backend scores each turn of a sample from that prefix.

The engine still samples from its cached decoding's distribution, which differs from the
scored one by rounding (about 1e-6 in logprob on the tiny model): the reported logprobs are
the trainer's, the draws are those of a distribution within rounding of it.
"""

from __future__ import annotations

import torch

#: transformers' ``experts_implementation`` both sides load a model with: each token's experts
#: applied to that token alone (it gathers every token's expert weights: memory grows with
#: tokens x experts per token x expert size, fine for small models). Dense models ignore it.
EXPERTS_IMPLEMENTATION = "batched_mm"

#: The fewest rows any matrix product of an exact forward or head runs with (products of at
#: least 12 rows give each row the same bits; the margin covers other CPUs' small-row kernels).
MIN_ROWS = 64


def generated_spans(token_mask: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of generated tokens (``token_mask`` > 0, 1-D) among the
    first ``length`` positions, in order: a sample's assistant turns, each scored from the
    prefix ``[0, end)``."""
    generated = (token_mask[:length] > 0).tolist()
    spans: list[tuple[int, int]] = []
    for t, on in enumerate(generated):
        if on and (t == 0 or not generated[t - 1]):
            spans.append((t, t + 1))
        elif on:
            spans[-1] = (spans[-1][0], t + 1)
    return spans


def pad_rows(x: torch.Tensor, minimum: int) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to ``minimum`` rows (``x`` itself when it
    has that many)."""
    missing = minimum - x.shape[0]
    return x if missing <= 0 else torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])
