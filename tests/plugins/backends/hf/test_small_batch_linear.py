"""The hf engine's weight-on-the-left linear product for decoding steps on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain_hf.small_batch_linear import SMALL_BATCH_ROWS, small_batch_linear, small_batch_linears


@pytest.mark.parametrize("shape", [(1, 96), (16, 96), (4, 1, 96), (2, 32, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_f_linears_to_float32_rounding(shape, bias):
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=generator), torch.randn(40, 96, generator=generator)
    b = torch.randn(40, generator=generator) if bias else None
    out = small_batch_linear(x, weight, b)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), F.linear(x.double(), weight.double(), None if b is None else b.double()),
                               rtol=1e-5, atol=1e-5)


def test_more_rows_than_a_decoding_step_take_f_linear_itself():
    x, weight, bias = torch.randn(SMALL_BATCH_ROWS + 1, 96), torch.randn(40, 96), torch.randn(40)
    assert torch.equal(small_batch_linear(x, weight, bias), F.linear(x, weight, bias))


def test_the_block_gives_the_models_own_linears_the_product_and_takes_it_back():
    class Adapter(torch.nn.Linear):  # a subclass (quantized, LoRA) keeps its own forward
        def forward(self, x):
            return super().forward(x) + 1.0

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Adapter(8, 8), torch.nn.ReLU())
    x = torch.randn(3, 8)
    with small_batch_linears(model):
        assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
        inside = model(x)
    assert not any("forward" in vars(m) for m in model)
    first = small_batch_linear(x, model[0].weight, model[0].bias)
    assert torch.equal(inside, model[2](model[1](first)))
    torch.testing.assert_close(inside, model(x))
