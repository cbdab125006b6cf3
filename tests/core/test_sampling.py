"""posttrain.backend.sampling: the distribution backends sample from (temperature, top-k, top-p
with vLLM's semantics) and the per-row seeds."""

from __future__ import annotations

import torch

from posttrain.backend.sampling import apply_top_k_top_p, sample_seeds, sampling_logprobs


def independent_filtered_logprobs(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """float64 reference, one row at a time: top-k keeps logits >= the k-th largest; top-p keeps
    the most likely tokens whose preceding (more likely) mass is below top_p."""
    out = torch.empty(logits.shape, dtype=torch.float64)
    for row, values in enumerate(logits.double() / temperature):
        keep = torch.ones_like(values, dtype=torch.bool)
        if top_k is not None:
            keep &= values >= values.topk(top_k).values[-1]
        probs = torch.where(keep, values, float("-inf")).softmax(0)
        if top_p < 1:
            order = probs.argsort(descending=True, stable=True)
            before = probs[order].cumsum(0) - probs[order]
            drop = order[before >= top_p]
            keep[drop] = False
        out[row] = torch.where(keep, values, float("-inf")).log_softmax(0)
    return out


def test_logprobs_match_an_independent_float64_computation():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=generator) * 3
    for temperature, top_k, top_p in [(1.0, None, 1.0), (0.6, None, 1.0), (0.8, 7, 1.0), (1.3, None, 0.75), (0.7, 12, 0.5)]:
        got = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        expected = independent_filtered_logprobs(logits, temperature, top_k, top_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(expected)), (temperature, top_k, top_p)
        finite = torch.isfinite(expected)
        torch.testing.assert_close(got[finite].double(), expected[finite], atol=1e-5, rtol=0)


def test_filter_keeps_ties_and_always_the_best_token():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 0.0]])
    assert torch.isfinite(apply_top_k_top_p(logits, 1, 1.0)).tolist() == [[True, False, True, False, False]]
    assert torch.isfinite(apply_top_k_top_p(logits, 3, 1.0)).tolist() == [[True, False, True, True, False]]
    assert int(torch.isfinite(apply_top_k_top_p(logits, None, 1e-6)).sum()) == 1
    assert apply_top_k_top_p(logits, None, 1.0) is logits


def test_greedy_logprobs_ignore_temperature_and_filters():
    logits = torch.tensor([[3.0, 1.0, 2.5, 2.0]])
    torch.testing.assert_close(sampling_logprobs(logits, temperature=0, top_k=1, top_p=0.1), logits.log_softmax(-1))


def test_row_seeds_are_deterministic_and_distinct():
    seeds = sample_seeds(42, 3, 1000)
    assert seeds == sample_seeds(42, 3, 1000) and seeds[:10] == sample_seeds(42, 3, 10)
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**32 for s in seeds)
    assert not set(seeds) & set(sample_seeds(42, 4, 1000))
    assert not set(seeds) & set(sample_seeds(43, 3, 1000))
