"""What a generation backend samples from, and the logprobs it reports: one definition.

Every backend samples token ``x_t`` from ``softmax(filter(logits_t / temperature))`` and
reports ``log`` of that same distribution at ``x_t``, where ``filter`` is top-k then top-p
(nucleus) masking with vLLM's semantics:

- top-k keeps every logit ``>=`` the k-th largest one (ties at the boundary are kept);
- top-p sorts the remaining logits ascending, removes those whose cumulative probability
  is ``<= 1 - top_p``, and always keeps the most likely token.

Without filtering (``top_k=None``, ``top_p=1``, the RL default) the reported logprob is
``log_softmax(logits / temperature)``, which is what a trainer computes. With filtering
it is the logprob under the renormalised, filtered distribution (vLLM's
``processed_logprobs``); a trainer that wants to match must apply :func:`sampling_logprobs`
with the same settings. Greedy decoding takes the argmax of the raw logits and reports
``log_softmax(logits)`` (temperature 1, no filter), as vLLM does.

Trainers (every policy backend) report logprobs of ``logits / T`` with
``T = logprob_temperature(generation.temperature)``, so that their logprobs and the
sampler's agree in the unfiltered case.

Sampling seeds: :func:`sample_seeds` gives each row of each ``generate`` call its own seed,
derived from the sampling seed (the run's seed, or the last ``set_sampling_seed``), the
call's index since then and the row's index in the call, so a row's sample does not
depend on how the batch is split over engines or microbatches.
"""

from __future__ import annotations

import hashlib

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k / top-p set with ``-inf`` (a new tensor; [..., vocab])."""
    if top_k is None and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = sorted_logits[..., -top_k].unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[..., -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_logprobs(
    logits: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities (float32, [..., vocab]) of the distribution a backend samples from.

    ``temperature == 0`` means greedy: ``log_softmax(logits)`` without scaling or filtering.
    """
    logits = logits.float()
    if temperature == 0:
        return logits.log_softmax(dim=-1)
    return apply_top_k_top_p(logits / temperature, top_k, top_p).log_softmax(dim=-1)


def logprob_temperature(temperature: float) -> float:
    """What a trainer divides logits by to match a backend sampling at ``temperature``:
    the temperature itself, or 1 for greedy decoding (``0``), whose logprobs are unscaled."""
    return temperature if temperature > 0 else 1.0


def sample_seeds(seed: int, call_index: int, num_rows: int) -> list[int]:
    """One 32-bit seed per row: ``blake2b("seed:call_index:row")`` truncated to 4 bytes."""
    return [
        int.from_bytes(hashlib.blake2b(f"{seed}:{call_index}:{row}".encode(), digest_size=4).digest(), "little")
        for row in range(num_rows)
    ]
