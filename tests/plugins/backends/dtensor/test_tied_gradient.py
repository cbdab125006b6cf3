"""Tied input and output embeddings on one rank (:mod:`posttrain_dtensor.tied_gradient`): the
gradients autograd's sum gives, with one ``[vocabulary, hidden]`` tensor made in a backward
pass instead of two or three (none filled with zeros, the head's kept as ``.grad`` without a copy), the
padding row left out as ``F.embedding`` leaves it, and autograd's own sum where one backward
follows two forwards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from posttrain.backend.logprobs import sequence_logprobs
from posttrain.testing.zoo import zoo_config
from posttrain_dtensor.parallel import CausalLMHead
from posttrain_dtensor.tied_gradient import tie_gradients

VOCAB = 4096


class VocabularyByHidden(TorchDispatchMode):
    """The storages of the ``[vocab, hidden]`` floating-point results of the ops it sees."""

    def __init__(self, shape: torch.Size):
        super().__init__()
        self.shape, self.storages = shape, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == self.shape:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(zoo_config("qwen3", vocab_size=VOCAB), dtype=torch.float32)
    tied_lm = copy.deepcopy(lm)
    tied = tie_gradients(tied_lm)
    assert tied is not None and tied_lm.get_input_embeddings().weight is tied_lm.get_output_embeddings().weight
    return CausalLMHead(lm), CausalLMHead(tied_lm, tied)


def batch(seed: int, pad: int):
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    ids[:, :3] = ids[0, 5]  # a token repeated: its rows add up
    ids[1, -4:] = pad  # padding: no gradient for its row
    predicted = torch.ones_like(ids, dtype=torch.bool)
    predicted[:, 0] = False
    return ids, predicted


def loss(root, ids, predicted):
    return -root(ids, None, None, lambda h, w: sequence_logprobs(h, w, ids, predicted, 1000)).sum()


def grads(root):
    return {name: p.grad.clone() for name, p in root.named_parameters()}


def assert_same_gradients(plain, tied):
    """The two models' gradients, name by name, within float32 rounding of sums in another order."""
    expected, found = grads(plain), grads(tied)
    assert expected.keys() == found.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_the_gradients_are_autograds_sum_over_microbatches(models):
    plain, tied = models
    pad = plain.lm.config.pad_token_id
    for root in models:
        root.zero_grad(set_to_none=True)
        for seed in (1, 2):  # two microbatches: the second accumulates into .grad
            loss(root, *batch(seed, pad)).backward()
    assert plain.lm.get_input_embeddings().padding_idx == pad  # the batch's padding is the padding row
    assert_same_gradients(plain, tied)


def test_one_vocabulary_sized_gradient_is_made_and_kept(models):
    plain, tied = models
    weight = tied.lm.get_input_embeddings().weight
    made = {}
    for name, root in (("plain", plain), ("tied", tied)):
        root.zero_grad(set_to_none=True)
        ids, predicted = batch(3, root.lm.config.pad_token_id)
        out = loss(root, ids, predicted)
        with VocabularyByHidden(weight.shape) as watch:
            out.backward()
        made[name] = watch.storages - {root.lm.get_input_embeddings().weight.untyped_storage().data_ptr()}
    # the head's gradient, the lookup's dense one (and, with torch 2.13, their sum out of place)
    assert len(made["plain"]) >= 2
    assert made["tied"] == {weight.grad.untyped_storage().data_ptr()}  # the head's, now .grad


def test_two_forwards_before_one_backward_take_autograds_sum(models):
    plain, tied = models
    pad = plain.lm.config.pad_token_id
    for root in models:
        root.zero_grad(set_to_none=True)
        (loss(root, *batch(4, pad)) + loss(root, *batch(5, pad))).backward()
    assert_same_gradients(plain, tied)


@pytest.mark.parametrize("case", ["untied", "frozen", "scaled"])
def test_embeddings_it_cannot_serve_are_left_as_they_are(case):
    from transformers import AutoModelForCausalLM

    name, overrides = {"untied": ("qwen3", {"tie_word_embeddings": False}), "frozen": ("qwen3", {}),
                       "scaled": ("gemma3", {})}[case]
    lm = AutoModelForCausalLM.from_config(zoo_config(name, **overrides), dtype=torch.float32)
    if case == "frozen":
        lm.requires_grad_(False)
    assert tie_gradients(lm) is None
    assert "forward" not in vars(lm.get_input_embeddings())
