"""Batched sampling with a KV cache on a transformers causal LM.

Prompts are left-padded inside (so every row's next token sits in the last column) and
rows leave the batch, and the cache, as soon as they finish. Rows with one prompt (a GRPO
group's samples) share its prefill: the prompt runs once and each row takes a copy of its
cache. What is sampled and which
logprob is reported is :func:`posttrain.backend.sampling.sampling_logprobs`; each row draws from its
own ``torch.Generator`` seeded with the request's seed for that row, so a row's sample
does not depend on the other rows or on how the batch is chunked (:class:`RowSampler`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from posttrain.backend.generation_group import Completion, GenerationRequest
from posttrain.backend.routing import Routers
from posttrain.backend.sampling import sampling_logprobs
from posttrain.backend.vision import embed_with_images, has_mrope, image_token_mask, mrope_positions
from posttrain.errors import WorkerError
from posttrain_hf.attention import takes_ready_step_masks
from posttrain_hf.stop_strings import StopStringMatcher


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    request: GenerationRequest,
    *,
    pad_token_id: int,
    stop_matcher: StopStringMatcher | None = None,
    routers: Routers | None = None,
) -> list[Completion]:
    """Complete every row of ``request``. ``stop_matcher`` is needed when rows have stop strings.
    With the model's ``routers``, each completion's ``routed_experts`` are the experts of every
    token the model ran: the prompt's and the generated ones but the last.

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
    prompt, prefill_attention, prefill_positions = {"input_ids": input_ids}, attention, positions
    source = list(range(num_rows))
    if request.images is not None and any(len(grid) for _, grid in request.images):
        prompt, positions = image_prompt(model, input_ids, attention, positions, request.images)
        prefill_positions = positions
    else:  # each distinct prompt runs once; the rows that repeat it take copies of its cache
        source, firsts = prompt_copies(request.prompts)
        if len(firsts) < num_rows:
            prefill = torch.tensor(firsts, device=device)
            prompt, prefill_attention, prefill_positions = {"input_ids": input_ids[prefill]}, attention[prefill], positions[prefill]

    greedy = request.temperature == 0
    sampler = None if greedy else RowSampler(request.seeds, device, max_steps=max(request.max_new_tokens))
    stop_ids = torch.tensor(sorted(set(request.stop_token_ids)), dtype=torch.long, device=device)
    cache = reserved_cache(model, width + max(request.max_new_tokens))
    logits = model(
        **prompt,
        attention_mask=prefill_attention,
        position_ids=prefill_positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    if len(logits) < num_rows:
        copies = torch.tensor(source, device=device)
        cache.batch_select_indices(copies)
        logits = logits[copies]
    routes = _prefill_routes(routers, request.prompts, width, source)
    next_position = positions.amax(dim=(0, 2)) + 1 if positions.dim() == 3 else positions[:, -1] + 1
    ready_masks = takes_ready_step_masks(model.config)
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
            attention_mask=attention.bool()[:, None, None, :] if ready_masks else attention,
            position_ids=next_position[:, None],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        if routers is not None:
            for row, step in zip(live, routers.take(), strict=True):
                routes[row].append(step[None])
        next_position = next_position + 1
    return [Completion(tokens[row], logprobs[row], truncated[row],
                       torch.cat(routes[row]) if routers is not None else None) for row in range(num_rows)]


def reserved_cache(model: PreTrainedModel, capacity: int) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``model``, its full-attention layers
    :class:`ReservedLayer` s of ``capacity`` tokens (sliding-window and other layers as they are)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are the first tokens of buffers with room for
    ``capacity``: a decoding step writes its token into the room instead of copying the
    layer's whole cache into a new tensor (``torch.cat``), which on the CPU at the Qwen3-0.6B
    shape (16 rows, 28 layers) took about a tenth of a 32-token generation. Selecting rows
    (rows that finish) makes new tensors, which the next step copies into new buffers; a
    layer that outgrows ``capacity`` gets buffers of twice its length."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.key_buffer = self._appended(self.keys, self.key_buffer, key_states)
        self.values, self.value_buffer = self._appended(self.values, self.value_buffer, value_states)
        return self.keys, self.values

    def _appended(self, held: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``held`` [rows, heads, tokens, dim] (or empty) with ``new`` after it along the
        tokens, as a view of ``buffer``, or of a new buffer where ``held`` is not the start of
        ``buffer`` or the room is spent."""
        length = held.shape[-2] if held.dim() == 4 else 0
        end = length + new.shape[-2]
        in_buffer = buffer is not None and length > 0 and held.data_ptr() == buffer.data_ptr() and held.shape[0] == buffer.shape[0]
        if not in_buffer or end > buffer.shape[-2]:  # past the capacity, room doubles
            room = self.capacity if end <= self.capacity else 2 * end
            buffer = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
            if length:
                buffer[..., :length, :] = held
        buffer[..., length:end, :] = new
        return buffer[..., :end, :], buffer


def image_prompt(
    model: PreTrainedModel, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
    images: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The prefill's input of left-padded ``input_ids`` (text ``positions``) of a
    vision-language model, each row with its ``images`` (pixel values, grids): the embeddings
    with the images' features on the image tokens (:mod:`posttrain.backend.vision`), and the
    positions by which decoding goes on (Qwen-VL's M-RoPE [3, rows, width]; else ``positions``)."""
    device = input_ids.device
    mask = image_token_mask(input_ids, [grid.to(device) for _, grid in images], model)
    grids = torch.cat([grid for _, grid in images]).to(device)
    pixels = torch.cat([pixels for pixels, _ in images]).to(device)
    embeds = embed_with_images(model, input_ids, pixels, grids, mask)
    if has_mrope(model):
        positions = mrope_positions(model, input_ids, mask, grids, attention)
    return {"inputs_embeds": embeds}, positions


def prompt_copies(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(source, firsts)``: for each row, the index of its prompt among the distinct prompts
    (in order of first appearance), and the first row of each distinct prompt."""
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
    firsts: list[int] = []
    for row, index in enumerate(source):
        if index == len(firsts):
            firsts.append(row)
    return source, firsts


def _prefill_routes(
    routers: Routers | None, prompts: list[list[int]], width: int, source: list[int]
) -> list[list[torch.Tensor]]:
    """Each row's prompt tokens' experts from the prefill forward (the distinct prompts,
    left-padded to ``width``; row ``i``'s is ``source[i]``), as the first part of the row's
    routes; empty lists without ``routers``."""
    if routers is None:
        return [[] for _ in prompts]
    prefill = routers.take().unflatten(0, (max(source) + 1, width))
    return [[prefill[source[row], width - len(prompt):]] for row, prompt in enumerate(prompts)]


class RowSampler:
    """One token per row, by inverse transform: for a uniform ``u`` from the row's own
    ``torch.Generator`` (seeded with its seed), the first token whose cumulative probability
    (summed in float64) exceeds ``u`` times the total (``u < 1``, and the product is kept
    below the total). A token of probability 0 is never drawn.

    Each row's uniforms for every step it may take are drawn when the sampler is made, one
    call per row, so a row's tokens depend only on its seed and its distributions, not on the
    other rows or on which of them are still decoding. The cumulative sums and the search run
    on the whole batch. At a 151,936-token vocabulary and 16 rows a step takes 4 ms on two CPU
    cores; ``torch.multinomial``'s method, one exponential per vocabulary entry from each
    row's generator, took 46 ms."""

    def __init__(self, seeds: list[int], device: torch.device, *, max_steps: int):
        self.uniforms = torch.stack([
            torch.rand(max_steps, generator=torch.Generator(device=device).manual_seed(seed), dtype=torch.float64, device=device)
            for seed in seeds
        ]) if seeds else torch.empty((0, max_steps), dtype=torch.float64, device=device)
        self.step = 0

    def draw(self, logprobs: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Tokens [len(rows)] for ``logprobs`` [len(rows), vocab], batch row ``i`` being
        request row ``rows[i]``; every call is the next step of each row in ``rows``.
        Raises :class:`WorkerError` on a non-finite distribution."""
        cumulative = logprobs.double().exp_().cumsum_(dim=-1)
        total = cumulative[:, -1:]
        if not bool(torch.isfinite(total).all()):  # a NaN or inf probability makes its row's total so
            raise WorkerError(
                "the generation model's next-token probabilities are not finite (NaN or inf logits): "
                "its weights may have diverged; check the training metrics (loss, grad_norm) of the last refit"
            )
        uniforms = self.uniforms[rows, self.step, None]
        self.step += 1
        # below the total, so the search lands on a token whose probability is above 0
        target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cumulative, target, right=True)[:, 0]
