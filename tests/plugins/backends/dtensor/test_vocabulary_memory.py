"""On a real vocabulary (Qwen 3's 151,936 rows), the dtensor backend's head never holds a
float32 ``[tokens, vocabulary]`` tensor: the model's forward and backward through
:class:`~posttrain_dtensor.parallel.CausalLMHead` with the chunked logprob head, top-k logits
and log-normalisers, watched by a dispatch mode that records every tensor with a vocabulary-
sized dimension. The largest is the output embedding itself ([vocabulary, hidden]) or its
gradient; a ``[tokens, vocabulary]`` tensor, with more tokens than hidden units, is larger.
Without chunks (one chunk of the whole vocabulary) the same watch sees the full logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from posttrain.backend.logprobs import logsumexp_logits, sequence_logprobs, topk_logits
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
