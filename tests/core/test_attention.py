"""posttrain.backend.attention: the sliding-window mask as transformers builds it, and attention
on explicit (soft-capped) scores as transformers' eager Gemma 2 kernel computes it."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from posttrain.backend.attention import scores_attention, window_binds, window_mask


@pytest.mark.parametrize(("queries", "keys", "window"), [(9, 9, 4), (1, 9, 4), (3, 12, 5), (6, 6, 8)])
def test_window_mask_is_transformers_sliding_window_mask(queries, keys, window):
    """Queries are the last positions of the keys (a decoding step, or a prompt continued)."""
    seen = sliding_window_causal_mask_function(window)
    offset = keys - queries
    q_idx, kv_idx = torch.arange(offset, keys)[:, None], torch.arange(keys)[None, :]
    want = seen(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    assert torch.equal(window_mask(queries, keys, window), want)
    assert torch.equal(window_mask(queries, keys, None), torch.ones(keys, keys, dtype=torch.bool).tril()[offset:])
    assert window_binds(keys, window) == (not torch.equal(window_mask(keys, keys, window), window_mask(keys, keys, None)))


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("mask_heads", [1, 4])
def test_scores_attention_is_transformers_eager_attention_with_its_gradients(softcap, mask_heads):
    """Four query heads over two key/value heads, a banded mask per row (the second row
    left-padded by 3), float32: outputs and gradients equal transformers' eager kernel under
    the equivalent additive mask; the soft-cap of 2 changes them."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float32, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float32, requires_grad=True) for _ in range(2))
    allowed = window_mask(7, 7, 4)[None, None].repeat(2, mask_heads, 1, 1)
    allowed[1, :, :, :3] = False
    allowed[1, :, :3, :3] = torch.eye(3, dtype=torch.bool)  # padding sees itself
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.4, softcap=softcap)
    got = scores_attention(q, k, v, allowed, scale=0.4, softcap=softcap).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    grad = torch.randn(want.shape, generator=g)
    for a, b in zip(torch.autograd.grad((got * grad).sum(), (q, k, v)), torch.autograd.grad((want * grad).sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    uncapped = scores_attention(q, k, v, allowed, scale=0.4).transpose(1, 2)
    assert (softcap is None) == bool(torch.equal(uncapped, got))
