"""The hf backend's decode loop on a transformers model, without Ray: sampling filters,
stop criteria and their precedence, independence of a row's sample from its batch, and the
row sampler against ``torch.multinomial``."""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.backend.generation_group import GenerationRequest
from posttrain.errors import WorkerError
from posttrain.testing.generation import stop_string_prefix
from posttrain_hf.decode import NOISE_STEPS_AHEAD, RowSampler, decode, noise_steps_ahead
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


@pytest.mark.parametrize("max_steps", [1, 24])
@pytest.mark.parametrize("vocab", [7, 103, 4099, 32000])
def test_row_sampler_draws_what_multinomial_draws_from_each_rows_generator(vocab, max_steps):
    """The decode loop's sampler makes torch.multinomial's draws, token for token, while rows
    leave the batch, on several vocabulary sizes (vectorised and scalar tails) and
    distributions from flat to peaked, with zeros; drawing one step's noise per call it also
    leaves every generator as multinomial does. With ``max_steps=24`` it draws 8 steps per row
    and call, and rows leave in the middle of those blocks."""
    seeds = list(range(40, 72))
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    sampler = RowSampler(seeds, torch.device("cpu"), max_steps=max_steps)
    rows = list(range(len(seeds)))
    random = torch.Generator().manual_seed(vocab)
    for step in range(24):
        logits = torch.randn(len(rows), vocab, generator=random) * (0.5 + step % 4 * 3)
        if step % 3 == 2:
            logits[:, ::3] = float("-inf")  # top-k/top-p filtered tokens: probability 0
        logprobs = logits.log_softmax(dim=-1)
        expected = [int(torch.multinomial(logprobs[i].exp(), 1, generator=generators[row])) for i, row in enumerate(rows)]
        assert sampler.draw(logprobs, rows).tolist() == expected, step
        if step % 5 == 4:
            rows = rows[1::2]  # rows finish and leave the batch
    assert sampler.noise.shape[1] == (1 if max_steps == 1 else 8)
    if max_steps == 1:
        for mine, theirs in zip(sampler.generators, generators, strict=True):
            assert torch.equal(mine.get_state(), theirs.get_state())


def test_noise_is_drawn_ahead_on_a_cpu_only_and_within_its_budget():
    cpu = torch.device("cpu")
    assert noise_steps_ahead(cpu, 128, 103, 64) == NOISE_STEPS_AHEAD == 8
    assert noise_steps_ahead(cpu, 128, 103, 3) == 3
    assert noise_steps_ahead(cpu, 128, 151936, 64) == 1  # 19.4M elements: one step over the budget
    assert noise_steps_ahead(cpu, 64, 151936, 64) == 1
    assert noise_steps_ahead(cpu, 16, 151936, 64) == 6
    assert noise_steps_ahead(torch.device("cuda"), 128, 103, 64) == 1


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


def test_routes_of_each_row_are_those_a_full_forward_over_its_tokens_chooses():
    """The engine's record of a mixture of experts' routes: left padding dropped, rows leaving
    the batch at different steps, every token the model ran (the prompt and all generated
    tokens but the last), each as the router chose it."""
    from transformers import AutoModelForCausalLM

    from posttrain.backend.generation_group import assemble_output
    from posttrain.backend.routing import NO_ROUTE, Routers
    from posttrain.testing.zoo import zoo_config

    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(zoo_config("qwen3_moe", tokenizer="character"), dtype=torch.float32).eval()
    routers = Routers(moe, record=True)
    rows = attrs.evolve(request(), max_new_tokens=[3, 7, 5])
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
