"""The hf backend's decode loop on a transformers model, without Ray: sampling filters,
stop criteria and their precedence, independence of a row's sample from its batch, shared
prompts' prefill, and the row sampler's distribution."""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.backend.generation_group import GenerationRequest
from posttrain.errors import WorkerError
from posttrain.testing.generation import stop_string_prefix
from posttrain_hf.decode import ReservedLayer, RowSampler, decode, prompt_copies
from posttrain_hf.stop_strings import StopStringMatcher

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    # Sharpen the near-uniform initial distribution so top-k/top-p and stops matter.
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def request(prompts=PROMPTS, *, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=12, stop_strings=None, stop_token_ids=(2,), seeds=None):
    return GenerationRequest(
        prompts=[list(p) for p in prompts],
        seeds=list(seeds or range(100, 100 + len(prompts))),
        max_new_tokens=[max_new_tokens] * len(prompts),
        stop_strings=[list(s) for s in (stop_strings or [[]] * len(prompts))],
        stop_token_ids=list(stop_token_ids),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )


@torch.no_grad()
def forward_logits(model, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    return model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()


@pytest.mark.parametrize("top_k,top_p", [(None, 1.0), (5, 1.0), (None, 0.6), (8, 0.7)])
def test_reported_logprobs_are_those_of_the_filtered_tempered_distribution(model, top_k, top_p):
    temperature = 0.8
    completions = decode(model, request(temperature=temperature, top_k=top_k, top_p=top_p), pad_token_id=0)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        logits = forward_logits(model, prompt, completion.token_ids)
        reference = torch.log_softmax(logits / temperature, dim=-1)
        if top_k is not None:  # independent top-k: keep logits >= the k-th largest
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            reference = torch.log_softmax((logits / temperature).masked_fill(logits < kth, float("-inf")), dim=-1)
        if top_p < 1.0:  # independent top-p: smallest most-likely set with mass >= top_p
            probs = reference.exp()
            kept = torch.zeros_like(probs, dtype=torch.bool)
            for t in range(probs.shape[0]):
                order = probs[t].argsort(descending=True)
                mass_before = probs[t][order].cumsum(0) - probs[t][order]
                kept[t, order[mass_before < top_p]] = True
            reference = torch.log_softmax(reference.masked_fill(~kept, float("-inf")), dim=-1)
        tokens = torch.tensor(completion.token_ids)
        expected = reference.gather(-1, tokens[:, None])[:, 0]
        assert torch.isfinite(expected).all(), "a sampled token lies outside the top-k/top-p set"
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected, atol=2e-5, rtol=0)


def test_row_sample_does_not_depend_on_the_rest_of_the_batch(model):
    together = decode(model, request(temperature=1.0), pad_token_id=0)
    alone = [decode(model, request([p], seeds=[100 + i]), pad_token_id=0)[0] for i, p in enumerate(PROMPTS)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    reseeded = decode(model, request(temperature=1.0, seeds=[7, 8, 9]), pad_token_id=0)
    assert [c.token_ids for c in reseeded] != [c.token_ids for c in together]


def test_rows_with_one_prompt_share_its_prefill_and_draw_as_they_would_alone(model):
    """A GRPO-like batch (two prompts, five rows): the prefill runs on the two distinct prompts,
    and each row's tokens and logprobs are those it gets decoded alone with its seed."""
    prompts, seeds = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[1]], [100, 101, 102, 103, 104]
    assert prompt_copies(prompts) == ([0, 1, 0, 0, 1], [0, 1])
    batches = []
    hook = model.model.register_forward_pre_hook(lambda _, args, kwargs: batches.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        together = decode(model, request(prompts, seeds=seeds), pad_token_id=0)
    finally:
        hook.remove()
    assert batches[0] == (2, len(PROMPTS[0])) and batches[1] == (5, 1)
    alone = [decode(model, request([p], seeds=[seed]), pad_token_id=0)[0] for p, seed in zip(prompts, seeds, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert len({tuple(together[row].token_ids) for row in (0, 2, 3)}) > 1  # copies of one prompt draw apart
    for mine, theirs in zip(together, alone, strict=True):
        torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)


def test_a_reserved_layer_holds_what_a_dynamic_layer_holds_and_writes_steps_in_place():
    """The decode loop's KV cache layer against transformers' ``DynamicLayer``: a prefill, steps,
    rows leaving and the room running out give the same keys and values at every step; steps
    within the room write into one buffer."""
    from transformers.cache_utils import DynamicLayer

    generator = torch.Generator().manual_seed(0)
    reserved, dynamic = ReservedLayer(capacity=10), DynamicLayer()
    pointers = set()
    for step, tokens in enumerate([5, 1, 1, 1, 1, 1, 1, 1]):
        rows = 3 if step < 4 else 2
        keys, values = torch.randn(rows, 2, tokens, 4, generator=generator), torch.randn(rows, 2, tokens, 4, generator=generator)
        if step == 4:  # a row finished
            for layer in (reserved, dynamic):
                layer.batch_select_indices(torch.tensor([0, 2]))
        mine, theirs = reserved.update(keys, values), dynamic.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), step
        assert reserved.get_seq_length() == dynamic.get_seq_length()
        pointers.add(mine[0].data_ptr())
    # a buffer at the prefill, a new one after the row left, a third (twice as large) at 11 tokens
    assert len(pointers) == 3


@pytest.mark.parametrize("vocab", [5, 151936])
def test_row_sampler_draws_each_token_at_its_probability_and_never_a_zero(vocab):
    """Many rows (20,000; 400 at Qwen's vocabulary size), one draw each from one distribution
    with zeros (the last entry among them, as top-k leaves it): every token's frequency is
    within 4.5 standard deviations of its probability, and no token of probability 0 is drawn."""
    probs = torch.zeros(vocab)
    probs[[0, 2, 3]] = torch.tensor([0.5, 0.2, 0.3])
    if vocab > 5:
        probs[vocab - 2] = 0.1  # far along a large vocabulary: the sums must still reach it
        probs /= probs.sum()
    rows = 20_000 if vocab == 5 else 400
    sampler = RowSampler(list(range(rows)), torch.device("cpu"), max_steps=1)
    tokens = sampler.draw(probs.log().expand(rows, vocab), list(range(rows)))
    counts = torch.bincount(tokens, minlength=vocab).double()
    spread = (rows * probs * (1 - probs)).double().sqrt()
    assert ((counts - rows * probs).abs() <= 4.5 * spread).all()
    assert counts[probs == 0].sum() == 0


def test_a_uniform_at_the_top_of_its_range_draws_the_last_token_with_probability():
    """``u`` just below 1 times a total rounded up could pass every cumulative sum; the
    sampler keeps the product below the total, so it lands on the last token that can be
    drawn, not on a zero behind it or past the vocabulary."""
    sampler = RowSampler([0, 1], torch.device("cpu"), max_steps=1)
    sampler.uniforms.fill_(1.0 - 2.0**-53)
    logprobs = torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0], [0.3, 0.3, 0.3, 0.1, 0.0]]).log()
    assert sampler.draw(logprobs, [0, 1]).tolist() == [2, 3]


def test_a_rows_tokens_depend_on_its_seed_alone():
    """Rows drawn together, with rows leaving the batch, draw what each draws alone with its
    seed; another seed draws otherwise."""
    seeds = list(range(40, 56))
    together = RowSampler(seeds, torch.device("cpu"), max_steps=12)
    alone = [RowSampler([seed], torch.device("cpu"), max_steps=12) for seed in seeds]
    random = torch.Generator().manual_seed(0)
    rows, drawn, reference = list(range(len(seeds))), [], []
    for step in range(12):
        logprobs = (torch.randn(len(rows), 4099, generator=random) * (0.5 + step % 4)).log_softmax(dim=-1)
        drawn.append(together.draw(logprobs, rows).tolist())
        reference.append([int(alone[row].draw(logprobs[i : i + 1], [0])) for i, row in enumerate(rows)])
        if step % 5 == 4:
            rows = rows[1::2]  # rows finish and leave the batch
    assert drawn == reference
    other = RowSampler([seed + 1000 for seed in seeds], torch.device("cpu"), max_steps=1)
    logprobs = torch.zeros(len(seeds), 4099).log_softmax(dim=-1)
    assert other.draw(logprobs, list(range(len(seeds)))).tolist() != RowSampler(
        seeds, torch.device("cpu"), max_steps=1).draw(logprobs, list(range(len(seeds)))).tolist()


def test_row_sampler_refuses_a_distribution_that_is_not_finite():
    logprobs = torch.zeros(2, 5).log_softmax(dim=-1)
    logprobs[1, 3] = float("nan")
    with pytest.raises(WorkerError, match=r"next-token probabilities are not finite \(NaN or inf logits\)"):
        RowSampler([1, 2], torch.device("cpu"), max_steps=4).draw(logprobs, [0, 1])


def test_budget_truncates_and_a_stop_token_on_the_last_step_is_a_stop(model):
    greedy = decode(model, request(temperature=0, max_new_tokens=6, stop_token_ids=()), pad_token_id=0)
    assert all(len(c.token_ids) == 6 and c.truncated for c in greedy)
    # Make each row's 4th greedy token a stop token: rows end there, not truncated, token kept.
    stops = {c.token_ids[3] for c in greedy}
    stopped = decode(model, request(temperature=0, max_new_tokens=6, stop_token_ids=stops), pad_token_id=0)
    for full, short in zip(greedy, stopped, strict=True):
        first = next(i for i, t in enumerate(full.token_ids) if t in stops)
        assert short.token_ids == full.token_ids[: first + 1] and not short.truncated
    last = decode(model, request(temperature=0, max_new_tokens=4, stop_token_ids=stops), pad_token_id=0)
    assert not any(c.truncated for c in last)


def test_stop_string_ends_the_row_at_the_token_that_completes_it(model, tokenizer):
    free = decode(model, request(temperature=0, max_new_tokens=16, stop_token_ids=()), pad_token_id=0)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in free]
    stops = [[text[5:7]] for text in texts]  # a two-character piece of each row's own text
    matcher = StopStringMatcher(tokenizer)
    stopped = decode(model, request(temperature=0, max_new_tokens=16, stop_strings=stops, stop_token_ids=()), pad_token_id=0, stop_matcher=matcher)
    for full, short, stop in zip(free, stopped, stops, strict=True):
        assert short.token_ids == stop_string_prefix(tokenizer, full.token_ids, stop[0])
        assert not short.truncated


def test_stop_strings_without_a_matcher_are_refused(model):
    with pytest.raises(ValueError, match="no StopStringMatcher"):
        decode(model, request(stop_strings=[["x"], [], []]), pad_token_id=0)


@pytest.mark.parametrize("prompts", [PROMPTS, [PROMPTS[0], PROMPTS[2], PROMPTS[0]]], ids=["distinct", "shared"])
def test_routes_of_each_row_are_those_a_full_forward_over_its_tokens_chooses(prompts):
    """The engine's record of a mixture of experts' routes: left padding dropped, rows leaving
    the batch at different steps, every token the model ran (the prompt and all generated
    tokens but the last), each as the router chose it; rows sharing a prompt's prefill take
    its routes."""
    from transformers import AutoModelForCausalLM

    from posttrain.backend.generation_group import assemble_output
    from posttrain.backend.routing import NO_ROUTE, Routers
    from posttrain.testing.zoo import zoo_config

    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(zoo_config("qwen3_moe", tokenizer="character"), dtype=torch.float32).eval()
    routers = Routers(moe, record=True)
    rows = attrs.evolve(request(prompts), max_new_tokens=[3, 7, 5])
    completions = decode(moe, rows, pad_token_id=0, routers=routers)
    assert [len(c.token_ids) for c in completions] == [3, 7, 5]  # rows leave the batch at different steps
    for prompt, completion in zip(rows.prompts, completions, strict=True):
        tokens = prompt + completion.token_ids[:-1]
        with torch.no_grad():
            moe(torch.tensor([tokens]))
        assert torch.equal(completion.routed_experts, routers.take())
    output = assemble_output(rows.prompts, completions, pad_token_id=0)
    routes = output["routed_experts"]
    assert routes.shape == (3, output["output_ids"].shape[1], 2, 2)
    for row, completion in enumerate(completions):
        n = len(completion.routed_experts)
        assert torch.equal(routes[row, :n], completion.routed_experts) and routes[row, n:].eq(NO_ROUTE).all()
