"""Exact logprobs on the hf engine (``generation.exact_logprobs``): every sampled token's
logprob computed again, after decoding, as the policy backend computes it.

Decoding with a KV cache gives each token logprobs from one-row products and attention over
the keys so far; the trainer's come from a full causal forward. :func:`rescore` runs, for
each row, its prompt plus completion (the turn's scoring prefix, :mod:`posttrain.backend.exact`)
through the model without cache or mask, rows of one length together (so each is the causal
attention of a sequence of exactly its length, as the trainer's segments are), in forwards
of at least :data:`~posttrain.backend.exact.MIN_ROWS` tokens (a group of fewer is repeated),
and applies the policy's chunked head (:func:`~posttrain.backend.logprobs.target_logprobs`) at
the policy's chunk size, the sampler's temperature and the model's final soft-cap. It runs in
the ``generate`` call that sampled the rows, so with the weights that sampled them.
"""

from __future__ import annotations

from collections import defaultdict

import attrs
import torch
from transformers import PreTrainedModel

from posttrain.backend.exact import MIN_ROWS
from posttrain.backend.generation_group import Completion
from posttrain.backend.logprobs import target_logprobs
from posttrain.backend.sampling import logprob_temperature


@torch.no_grad()
def rescore(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[Completion],
    *,
    temperature: float,
    chunk_size: int,
    max_batch_size: int,
) -> list[Completion]:
    """``completions`` with each token's logprob replaced by the policy's: that of
    ``logits / logprob_temperature(temperature)`` from a full forward over the row's prompt
    and completion. At most ``max_batch_size`` rows per forward; ``chunk_size`` is the
    policy's ``logprob_chunk_size``."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        by_length[len(prompt) + len(completion.token_ids)].append(row)
    weight = model.get_output_embeddings().weight
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    scored: dict[int, list[float]] = {}
    for length, group in by_length.items():
        for start in range(0, len(group), max_batch_size):
            rows = group[start:start + max_batch_size]
            ids = torch.tensor([prompts[r] + completions[r].token_ids for r in rows], device=model.device)
            copies = -(-MIN_ROWS // (len(rows) * length))
            hidden = model.base_model(input_ids=ids.repeat(copies, 1), use_cache=False).last_hidden_state
            # position t - 1 predicts token t: the completion's tokens are predicted from len(prompt) - 1 on
            take = [(i, len(prompts[r])) for i, r in enumerate(rows)]
            values = target_logprobs(
                torch.cat([hidden[i, begin - 1:length - 1] for i, begin in take]),
                weight,
                torch.cat([ids[i, begin:] for i, begin in take]),
                chunk_size,
                logprob_temperature(temperature),
                softcap=float(softcap) if softcap else None,
                min_rows=MIN_ROWS,
            ).tolist()
            for r in rows:
                count = len(completions[r].token_ids)
                scored[r], values = values[:count], values[count:]
    return [attrs.evolve(completion, logprobs=scored[row]) for row, completion in enumerate(completions)]
