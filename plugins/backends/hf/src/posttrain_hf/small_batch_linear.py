"""Linear layers for decoding steps on the CPU: the weight on the left of the product.

A decoding step multiplies a few rows (one per sequence) by every weight, so it is bound by
reading the weights. On a CPU, ``weight @ x.T`` reads a ``[out, in]`` weight 30 to 50% faster
than ``F.linear``'s ``x @ weight.T`` at 12 to 64 rows (x86, MKL, float32, weights larger than
the cache; ``benchmarks/small_batch_linear.py`` measures both), and as fast at fewer rows.
The products are the same dot products, summed in another order: the last bit may differ.

:func:`small_batch_linears` puts that product in every ``torch.nn.Linear`` of a model for the
length of a ``with`` block; an input of more rows (a prompt's prefill), or off the CPU, takes
``F.linear`` as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType

import torch
import torch.nn.functional as F

#: Inputs of at most this many rows (tokens) take the weight-on-the-left product.
SMALL_BATCH_ROWS = 64


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``(weight @ x.T).T`` when ``x`` is on the CPU
    and has at most :data:`SMALL_BATCH_ROWS` rows; the result is contiguous either way."""
    rows = x.shape[:-1].numel()
    if x.device.type != "cpu" or rows > SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).t()
    out = torch.mm(weight, flat) if bias is None else torch.addmm(bias[:, None], weight, flat)
    return out.t().contiguous().view(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return small_batch_linear(x, self.weight, self.bias)


@contextmanager
def small_batch_linears(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every ``torch.nn.Linear`` of ``model`` (the class itself, not a
    subclass such as a quantized or adapter layer) computes :func:`small_batch_linear`."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)]
    for module in linears:
        module.forward = MethodType(_forward, module)
    try:
        yield
    finally:
        for module in linears:
            del module.forward
