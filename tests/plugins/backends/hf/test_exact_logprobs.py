"""Exact logprobs, without Ray: the hf engine's rescored logprobs of a two-turn rollout are,
bit for bit, what the dtensor trainer computes for the same samples (its exact rows, run as
the worker runs them), on every architecture of the model zoo; the cached decoding's own
logprobs are not (the gap exact mode removes)."""

from __future__ import annotations

import pytest
import torch

from posttrain.backend.engine import GenerationRequest
from posttrain.backend.exact import EXPERTS_IMPLEMENTATION, MIN_ROWS
from posttrain.backend.logprobs import sequence_logprobs
from posttrain.testing.zoo import ARCHITECTURES
from posttrain_dtensor.parallel import CausalLMHead, output_softcap
from posttrain_dtensor.rows import exact_rows
from posttrain_dtensor.segment_attention import EXACT_SEGMENT_SDPA
from posttrain_hf.attention import SHARED_KV_SDPA
from posttrain_hf.decode import decode
from posttrain_hf.exact import rescore

CHUNK = 40
PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75]]


def load(path: str, kernel: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=kernel, experts_implementation=EXPERTS_IMPLEMENTATION
    ).eval()


def rollout(engine, temperature: float, max_batch_size: int):
    """Two turns with an observation between them: per row, the token ids, the generated mask,
    the rescored and the cached decoding's logprobs (0 off the generated tokens)."""
    rows = [list(p) for p in PROMPTS]
    masks = [[0.0] * len(p) for p in rows]
    exact = [[0.0] * len(p) for p in rows]
    cached = [[0.0] * len(p) for p in rows]
    for turn in range(2):
        request = GenerationRequest(prompts=[list(r) for r in rows], seeds=[10 * turn + i for i in range(len(rows))],
                                    max_new_tokens=[6 + 3 * i for i in range(len(rows))],
                                    stop_strings=[[] for _ in rows], stop_token_ids=[], temperature=temperature,
                                    top_p=1.0, top_k=None)
        completions = decode(engine, request, pad_token_id=0)
        scored = rescore(engine, request.prompts, completions, temperature=temperature, chunk_size=CHUNK,
                         max_batch_size=max_batch_size)
        for i, (done, again) in enumerate(zip(completions, scored, strict=True)):
            observation = [] if turn else [80 + i, 81, 82][: 1 + i % 3]
            rows[i] += done.token_ids + observation
            masks[i] += [1.0] * len(done.token_ids) + [0.0] * len(observation)
            exact[i] += again.logprobs + [0.0] * len(observation)
            cached[i] += done.logprobs + [0.0] * len(observation)
    width = max(map(len, rows))

    def pad(values, dtype):
        return torch.tensor([v + [0] * (width - len(v)) for v in values], dtype=dtype)

    return pad(rows, torch.long), pad(masks, torch.float32), pad(exact, torch.float32), pad(cached, torch.float32)


@torch.no_grad()
def trainer_logprobs(path: str, ids, mask, temperature: float):
    model = CausalLMHead(load(path, EXACT_SEGMENT_SDPA))
    lengths = (mask > 0).cumsum(1).argmax(1) + 1  # through the last generated token
    rows = exact_rows(ids, lengths, mask)
    softcap = output_softcap(model.lm)
    values = model(rows.input_ids, rows.attention_mask, rows.position_ids,
                   lambda h, w: sequence_logprobs(h, w, rows.input_ids, rows.predicted, CHUNK, temperature,
                                                  softcap=softcap, min_rows=MIN_ROWS),
                   rows.segment_bounds)
    return rows.to_samples(values)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_rescored_logprobs_are_the_trainers_bit_for_bit(zoo_model, arch):
    """Each architecture with its family's BPE tokenizer (a 576-row vocabulary: 15 chunks of
    the head here)."""
    path = zoo_model(arch)
    engine = load(path, SHARED_KV_SDPA)
    ids, mask, exact, cached = rollout(engine, temperature=0.8, max_batch_size=3)
    trainer = trainer_logprobs(path, ids, mask, 0.8)
    assert int(mask.sum()) > 40
    assert torch.equal(exact, trainer)
    gap = (cached - trainer).abs()
    assert 0 < gap.max() < 1e-4, f"the cached decoding's gap on {arch}: {gap.max():.3g}"


def test_rescoring_does_not_depend_on_the_rows_beside(tiny_model_path):
    """One row per forward, or every row at once: the same bits (greedy calls rescore at
    temperature 1, as the trainer scores a greedy run)."""
    engine = load(tiny_model_path, SHARED_KV_SDPA)
    request = GenerationRequest(prompts=PROMPTS, seeds=[0] * 4, max_new_tokens=[5] * 4, stop_strings=[[]] * 4,
                                stop_token_ids=[], temperature=0.0, top_p=1.0, top_k=None)
    completions = decode(engine, request, pad_token_id=0)
    one, many = (rescore(engine, PROMPTS, completions, temperature=0.0, chunk_size=CHUNK, max_batch_size=size)
                 for size in (1, 64))
    assert [c.logprobs for c in one] == [c.logprobs for c in many]
    assert [c.token_ids for c in one] == [c.token_ids for c in completions]
    torch.testing.assert_close(torch.tensor([c.logprobs for c in one]), torch.tensor([c.logprobs for c in completions]),
                               rtol=0, atol=1e-5)
