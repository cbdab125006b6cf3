"""Batched sampling with a KV cache on a transformers causal LM.

Prompts are left-padded inside (so every row's next token sits in the last column) and
rows leave the batch, and the cache, as soon as they finish. What is sampled and which
logprob is reported is :func:`posttrain.backend.sampling.sampling_logprobs`; each row draws from its
own ``torch.Generator`` seeded with the request's seed for that row, so a row's sample
does not depend on the other rows or on how the batch is chunked (:class:`RowSampler`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from posttrain.backend.generation_group import Completion, GenerationRequest
from posttrain.backend.sampling import sampling_logprobs
from posttrain.errors import WorkerError
from posttrain_hf.stop_strings import StopStringMatcher


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    request: GenerationRequest,
    *,
    pad_token_id: int,
    stop_matcher: StopStringMatcher | None = None,
) -> list[Completion]:
    """Complete every row of ``request``. ``stop_matcher`` is needed when rows have stop strings.

    A row ends at a stop token (kept), at a stop string (ending with the token that
    completed it), or at its ``max_new_tokens`` budget (``truncated``), checked in that
    order after each token, as vLLM does.
    """
    num_rows = len(request)
    if num_rows == 0:
        return []
    if stop_matcher is None and any(request.stop_strings):
        raise ValueError("rows have stop strings but no StopStringMatcher was given")
    device = model.device
    width = max(len(p) for p in request.prompts)
    input_ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((num_rows, width), dtype=torch.long)
    for row, prompt in enumerate(request.prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)

    greedy = request.temperature == 0
    sampler = None if greedy else RowSampler(request.seeds, device)
    stop_ids = torch.tensor(sorted(set(request.stop_token_ids)), dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    next_position = positions[:, -1] + 1
    live = list(range(num_rows))  # the original row of each batch row still decoding
    tokens: list[list[int]] = [[] for _ in range(num_rows)]
    logprobs: list[list[float]] = [[] for _ in range(num_rows)]
    truncated = [False] * num_rows

    while True:
        step_logprobs = sampling_logprobs(logits, temperature=request.temperature, top_k=request.top_k, top_p=request.top_p)
        chosen = logits.argmax(dim=-1) if sampler is None else sampler.draw(step_logprobs, live)
        chosen_logprobs = step_logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
        stopped = torch.isin(chosen, stop_ids).tolist()
        chosen_ids = chosen.tolist()
        keep = []
        for i, row in enumerate(live):
            tokens[row].append(chosen_ids[i])
            logprobs[row].append(chosen_logprobs[i])
            if stopped[i] or (request.stop_strings[row] and stop_matcher.hit(tokens[row], request.stop_strings[row])):
                continue
            if len(tokens[row]) >= request.max_new_tokens[row]:
                truncated[row] = True
                continue
            keep.append(i)
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            attention, next_position, chosen = attention[index], next_position[index], chosen[index]
            live = [live[i] for i in keep]
        attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=1)
        logits = model(
            input_ids=chosen[:, None],
            attention_mask=attention,
            position_ids=next_position[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1
    return [Completion(tokens[row], logprobs[row], truncated[row]) for row in range(num_rows)]


class RowSampler:
    """One token per row from the row's own ``torch.Generator`` (seeded with its seed), the
    draw ``torch.multinomial(logprobs.exp(), 1, generator=...)`` makes, number for number: the
    index of the largest ``p / q`` with ``q ~ Exp(1)`` drawn from the generator over the
    vocabulary (torch's own method for one sample; the generators end in the same states).
    Only the noise is drawn row by row; the exponential, the check, the division and the
    argmax run on the whole batch, in buffers kept across steps (a ``torch.multinomial`` per
    row and token spent a third of a small model's decoding in per-call work; torch's
    element-wise ``exp`` gives each element the same bits in a batch as in its row alone)."""

    def __init__(self, seeds: list[int], device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        self.probs = self.noise = torch.empty(0)

    def draw(self, logprobs: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Tokens [len(rows)] for ``logprobs`` [len(rows), vocab] (float32), batch row ``i``
        being request row ``rows[i]``. Raises :class:`WorkerError` on a non-finite distribution."""
        live, vocab = logprobs.shape
        if self.noise.shape[-1] != vocab:  # the first step has every row
            self.probs, self.noise = (logprobs.new_empty((len(self.generators), vocab)) for _ in range(2))
        probs, noise = torch.exp(logprobs, out=self.probs[:live]), self.noise[:live]
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=self.generators[row])
        if not bool(((probs >= 0) & (probs < float("inf"))).all()):
            raise WorkerError(
                "the generation model's next-token probabilities are not finite (NaN or inf logits): "
                "its weights may have diverged; check the training metrics (loss, grad_norm) of the last refit"
            )
        return torch.div(probs, noise, out=noise).argmax(dim=-1)
