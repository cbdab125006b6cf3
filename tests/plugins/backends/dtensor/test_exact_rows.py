"""Exact logprobs on the dtensor backend, without Ray: the rows of :func:`exact_rows` score each
turn from its own prefix, so a sample's logprobs have the same bits whatever microbatch it is
in, and the gradients are those of the ordinary rows; LoRA layers computing with the merged
weight give the bits of a plain layer holding it."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.backend.exact import MIN_ROWS
from posttrain.backend.logprobs import sequence_logprobs
from posttrain.config.schema import LoraConfig, PolicyConfig, RunConfig
from posttrain_dtensor.lora import ADAPTER, adapters_disabled, attach_adapters, compute_merged
from posttrain_dtensor.parallel import CausalLMHead
from posttrain_dtensor.rows import exact_rows, padded_rows
from posttrain_dtensor.segment_attention import EXACT_SEGMENT_SDPA, SEGMENT_SDPA

CHUNK = 16


def two_turn_batch(seed: int = 0):
    """Right-padded samples: a prompt, a generated turn, an observation, a second turn (the
    last sample has one turn only); ``token_mask`` is 1 on the generated tokens."""
    g = torch.Generator().manual_seed(seed)
    layouts = [(4, 6, 3, 5), (2, 9, 5, 2), (6, 3, 2, 8), (3, 12, 0, 0), (5, 4, 7, 11)]
    width = max(sum(parts) for parts in layouts) + 2
    ids = torch.zeros(len(layouts), width, dtype=torch.long)
    mask = torch.zeros(len(layouts), width)
    for i, (prompt, first, observation, second) in enumerate(layouts):
        n = prompt + first + observation + second
        ids[i, :n] = torch.randint(7, 100, (n,), generator=g)
        mask[i, prompt:prompt + first] = 1
        mask[i, prompt + first + observation:n] = 1
    lengths = torch.tensor([sum(parts) for parts in layouts])
    return ids, lengths, mask, layouts


def head_logprobs(model: CausalLMHead, rows, min_rows: int = MIN_ROWS) -> torch.Tensor:
    values = model(rows.input_ids, rows.attention_mask, rows.position_ids,
                   lambda h, w: sequence_logprobs(h, w, rows.input_ids, rows.predicted, CHUNK, min_rows=min_rows),
                   rows.segment_bounds)
    return rows.to_samples(values)


def load(path: str, kernel: str) -> CausalLMHead:
    from transformers import AutoModelForCausalLM

    return CausalLMHead(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=kernel))


@torch.no_grad()
def test_each_turn_is_scored_from_its_own_prefix_alone(tiny_model_path):
    """The rows hold every turn's prefix end to end (a row of a multiple of MIN_ROWS tokens);
    a turn's logprobs are, bit for bit, those of its prefix run alone; nothing is reported off
    the generated tokens."""
    ids, lengths, mask, layouts = two_turn_batch()
    rows = exact_rows(ids, lengths, mask)
    prefix_lengths = [end for p, f, o, s in layouts for end in ((p + f, p + f + o + s) if s else (p + f,))]
    assert rows.input_ids.shape == (1, -(-sum(prefix_lengths) // MIN_ROWS) * MIN_ROWS)
    assert int(rows.predicted.sum()) == int(mask.sum())
    model = load(tiny_model_path, EXACT_SEGMENT_SDPA)
    got = head_logprobs(model, rows)
    assert torch.all(got[mask == 0] == 0)
    for i, (prompt, first, observation, second) in enumerate(layouts):
        for start, end in ((prompt, prompt + first), (prompt + first + observation, prompt + first + observation + second)):
            if start == end:
                continue
            alone = exact_rows(ids[i:i + 1, :end], torch.tensor([end]), mask[i:i + 1, :end] * (torch.arange(end) >= start))
            assert torch.equal(got[i, start:end], head_logprobs(model, alone)[0, start:end]), (i, start)


@torch.no_grad()
def test_a_samples_logprobs_do_not_depend_on_its_microbatch(tiny_model_path):
    """Exact rows: every split and order of the batch gives the same bits. Ordinary padded rows
    do not (a sample's attention depends on the width it is padded to), the control that shows
    the comparison can fail."""
    ids, lengths, mask, _ = two_turn_batch(seed=1)
    model = load(tiny_model_path, EXACT_SEGMENT_SDPA)
    whole = head_logprobs(model, exact_rows(ids, lengths, mask))
    order = [3, 0, 4, 2, 1]
    shuffled = head_logprobs(model, exact_rows(ids[order], lengths[order], mask[order]))
    assert torch.equal(shuffled, whole[order])
    for split in ([0, 1], [2], [3, 4]):
        assert torch.equal(head_logprobs(model, exact_rows(ids[split], lengths[split], mask[split])), whole[split])

    ordinary = load(tiny_model_path, SEGMENT_SDPA)
    together = head_logprobs(ordinary, padded_rows(ids, lengths), min_rows=0)
    alone = torch.cat([head_logprobs(ordinary, padded_rows(ids[i:i + 1], lengths[i:i + 1]), min_rows=0) for i in range(5)])
    assert not torch.equal(together * mask, alone * mask)
    torch.testing.assert_close(together * mask, whole, rtol=0, atol=1e-5)  # the same function, other roundings


def test_gradients_are_those_of_the_ordinary_rows(tiny_model_path):
    ids, lengths, mask, _ = two_turn_batch(seed=2)
    grads = []
    for kernel, rows in ((EXACT_SEGMENT_SDPA, exact_rows(ids, lengths, mask)), (SEGMENT_SDPA, padded_rows(ids, lengths))):
        model = load(tiny_model_path, kernel)
        ((head_logprobs(model, rows) * mask).sum() / mask.sum()).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=0, atol=1e-6, msg=name)


def test_a_microbatch_without_generated_tokens_scores_nothing(tiny_model_path):
    ids, lengths, mask, _ = two_turn_batch()
    rows = exact_rows(ids[:2], lengths[:2], torch.zeros_like(mask[:2]))
    assert not rows.predicted.any()
    with torch.no_grad():
        assert torch.all(head_logprobs(load(tiny_model_path, EXACT_SEGMENT_SDPA), rows) == 0)


def test_lora_layers_compute_with_the_merged_weight(tiny_model_path):
    """compute_merged: an adapted layer's output is, bit for bit, a plain linear layer's holding
    W + (B @ A) * scale (the tensor a merged refit sends); outputs and gradients of A and B are
    peft's own within rounding; with the adapters disabled it is the base layer."""
    from transformers import AutoModelForCausalLM

    config = RunConfig(policy=PolicyConfig(model=tiny_model_path, lora=LoraConfig(enabled=True, rank=4, alpha=8.0)))
    models, layers = [], []
    for merged in (False, True):
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        adapted = attach_adapters(lm, config)
        for layer in adapted.values():
            nn.init.normal_(layer.lora_B[ADAPTER].weight, std=0.1)  # B = 0 would hide the adapters
        if merged:
            compute_merged(adapted)
        models.append(lm)
        layers.append(adapted)
    name, layer = next(iter(layers[1].items()))
    x = torch.randn(3, 7, layer.get_base_layer().in_features)
    weight = layer.get_base_layer().weight + (layer.lora_B[ADAPTER].weight @ layer.lora_A[ADAPTER].weight) * layer.scaling[ADAPTER]
    assert torch.equal(layer(x), nn.functional.linear(x, weight, layer.get_base_layer().bias))
    with adapters_disabled(models[1]):
        assert torch.equal(layer(x), layer.get_base_layer()(x))

    ids = torch.randint(7, 100, (2, 12))
    for lm in models:
        lm(input_ids=ids).logits.square().mean().backward()
    peft_layer = layers[0][name]
    torch.testing.assert_close(layer(x), peft_layer(x), rtol=0, atol=1e-5)
    for matrix in ("lora_A", "lora_B"):
        torch.testing.assert_close(getattr(layer, matrix)[ADAPTER].weight.grad, getattr(peft_layer, matrix)[ADAPTER].weight.grad,
                                   rtol=1e-4, atol=1e-6)
