"""On a real vocabulary (Qwen 3's 151,936 rows), the dtensor backend's head never holds a
float32 ``[tokens, vocabulary]`` tensor: the model's forward and backward through
:class:`~posttrain_dtensor.parallel.CausalLMHead` with the chunked logprob head, top-k logits
and log-normalisers, watched by a dispatch mode that records every tensor with a vocabulary-
sized dimension. The largest is the output embedding itself ([vocabulary, hidden]) or its
gradient; a ``[tokens, vocabulary]`` tensor, with more tokens than hidden units, is larger.
Without chunks (one chunk of the whole vocabulary) the same watch sees the full logits.

The head's own peak memory, counted tensor by tensor (torch's ``MemTracker``), beyond its
inputs and their gradients: the same at 151,936 rows as at 8,192, and within a few ``[chunk,
hidden]`` float32 blocks, for float32 and bfloat16 weights and for one or 64 targets per row (a
teacher's top-k). A float32 gradient buffer of the whole vocabulary (bfloat16 weights: 149 MiB
here) or a ``[tokens, k, hidden]`` gather (8 MiB) would exceed it."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from posttrain.backend.logprobs import logsumexp_logits, sequence_logprobs, target_logprobs, topk_logits
from posttrain.testing.zoo import zoo_config
from posttrain_dtensor.parallel import CausalLMHead

VOCAB = 151_936
ROWS, TOKENS = 2, 160  # 320 tokens, more than the hidden size (64)


class LargestVocabularyTensor(TorchDispatchMode):
    """Records the most elements of any floating-point result with a ``vocab``-sized dimension."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and self.vocab in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture(scope="module")
def root():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return CausalLMHead(AutoModelForCausalLM.from_config(zoo_config("qwen3", vocab_size=VOCAB), dtype=torch.float32))


def largest_in_a_step(root, chunk: int) -> int:
    ids = torch.randint(0, 500, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    predicted = torch.ones(ROWS, TOKENS, dtype=torch.bool)
    predicted[:, 0] = False
    root.zero_grad(set_to_none=True)
    with LargestVocabularyTensor(VOCAB) as watch:
        logprobs = root(ids, None, None, lambda h, w: sequence_logprobs(h, w, ids, predicted, chunk, 0.7))
        (-logprobs.sum()).backward()
        with torch.no_grad():
            root(ids, None, None, lambda h, w: (topk_logits(h[0], w, 4, chunk), logsumexp_logits(h[0], w, chunk, 0.7)))
    return watch.largest


def test_no_tokens_by_vocabulary_tensor_beyond_the_chunk(root):
    hidden = root.lm.config.hidden_size
    assert largest_in_a_step(root, chunk=1024) == VOCAB * hidden  # the output embedding and its gradient


def test_the_watch_sees_full_logits(root):
    assert largest_in_a_step(root, chunk=VOCAB) >= ROWS * (TOKENS - 1) * VOCAB


def head_extra_bytes(vocab: int, dtype: torch.dtype, k: int | None, tokens=128, hidden=256, chunk=1024) -> int:
    """Peak bytes of one forward and backward of :func:`target_logprobs` beyond the weight,
    the hidden states and their gradients."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype))
    hidden_states = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,) if k is None else (tokens, k), generator=gen)
    tracker = MemTracker()
    tracker.track_external(weight, hidden_states)
    with tracker:
        target_logprobs(hidden_states, weight, targets, chunk).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert weight.grad.dtype == dtype and hidden_states.grad.dtype == dtype
    inputs = weight.numel() * weight.element_size() + hidden_states.numel() * hidden_states.element_size()
    return peak - 2 * inputs


@pytest.mark.parametrize("k", [None, 64], ids=["one_target", "top64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_head_peak_memory_is_bounded_by_the_chunk_not_the_vocabulary(dtype, k):
    chunk, hidden = 1024, 256
    extra = head_extra_bytes(VOCAB, dtype, k, hidden=hidden, chunk=chunk)
    assert extra == head_extra_bytes(8 * chunk, dtype, k, hidden=hidden, chunk=chunk)
    assert extra <= 4 * chunk * hidden * 4, f"{extra / 2**20:.1f} MiB beyond the inputs and gradients"
