"""The dtensor backend's pure pieces, without Ray or torch.distributed: chunked logprobs and
top-k, packed vs padded rows, pass planning, schedules, buckets, counts and validation."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.backend.hf_export import bucket_names
from posttrain.backend.logprobs import (
    logsumexp_logits,
    loss_positions,
    sequence_logprobs,
    target_logprobs,
    topk_logits,
)
from posttrain.backend.lr_schedule import build_scheduler, lr_factor
from posttrain.backend.work import Batching, plan_pass
from posttrain.config.schema import OptimizerConfig, SchedulerConfig
from posttrain.errors import ConfigError
from posttrain.interfaces.loss import global_valid_counts
from posttrain_dtensor.config import DTensorConfig, validate_policy_config
from posttrain_dtensor.optim import build_optimizer, clip_grads_, total_grad_norm
from posttrain_dtensor.parallel import CausalLMHead, output_softcap
from posttrain_dtensor.rows import packed_rows, padded_rows
from posttrain_dtensor.segment_attention import SEGMENT_SDPA, segment_plan, segment_sdpa

VOCAB, HIDDEN = 37, 12


def _head_inputs(n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    return hidden, weight, targets


def assert_grads_match(h32, h64, w32, w64) -> None:
    """The float32 gradients of hidden and weight against float64's. They reach about 7 here:
    float32 sums over a chunk leave a few parts in 1e6 of that, which depends on the machine's
    kernels (1.02e-5 seen against 1e-5 of absolute tolerance)."""
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 8, VOCAB, VOCAB + 5])
def test_chunked_logprobs_and_grads_match_float64_log_softmax(chunk):
    hidden, weight, targets = _head_inputs()
    coef = torch.linspace(-1.0, 2.0, len(targets))
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = target_logprobs(h32, w32, targets, chunk)
    (got * coef).sum().backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = (h64 @ w64.T).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (want * coef.double()).sum().backward()

    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
    assert_grads_match(h32, h64, w32, w64)


def test_chunked_logprob_backward_passes_gradcheck():
    hidden, weight, targets = _head_inputs(n=5)
    inputs = (hidden.double().requires_grad_(), weight.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: target_logprobs(h, w, targets, 8), inputs)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_tempered_logprobs_and_grads_match_float64_log_softmax_of_scaled_logits(temperature):
    hidden, weight, targets = _head_inputs(seed=3)
    coef = torch.linspace(-1.0, 2.0, len(targets))
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = target_logprobs(h32, w32, targets, 8, temperature)
    (got * coef).sum().backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = (h64 @ w64.T / temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (want * coef.double()).sum().backward()

    torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
    assert_grads_match(h32, h64, w32, w64)
    untempered = target_logprobs(hidden, weight, targets, 8)
    assert (got.detach() - untempered).abs().max() > 0.1  # the temperature did change them


def test_tempered_logprob_backward_passes_gradcheck():
    hidden, weight, targets = _head_inputs(n=5)
    inputs = (hidden.double().requires_grad_(), weight.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: target_logprobs(h, w, targets, 8, 0.7), inputs)


@pytest.mark.parametrize("chunk", [1, 8, VOCAB])
def test_logprobs_of_several_targets_per_row_and_grads_match_float64(chunk):
    """K ids per row (a teacher's top-k): each one's logprob, and gradients through all of them."""
    hidden, weight, _ = _head_inputs(seed=5)
    targets = torch.randint(0, VOCAB, (len(hidden), 4), generator=torch.Generator().manual_seed(6))
    coef = torch.linspace(-1.0, 2.0, targets.numel()).view(targets.shape)
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = target_logprobs(h32, w32, targets, chunk, 0.8)
    (got * coef).sum().backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = (h64 @ w64.T / 0.8).log_softmax(-1).gather(-1, targets)
    (want * coef.double()).sum().backward()

    assert got.shape == targets.shape
    torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
    assert_grads_match(h32, h64, w32, w64)
    inputs = (hidden[:4].double().requires_grad_(), weight.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: target_logprobs(h, w, targets[:4], 8), inputs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_softcapped_logprobs_topk_and_grads_match_float64_of_capped_logits(temperature):
    """Gemma 2's final-logit soft-cap, ``cap * tanh(logits / cap)``, before the temperature:
    logprobs of one and of several targets per row, their gradients, the normaliser and
    top-k against float64 autograd of the capped logits; a cap of 3 binds on these logits
    (up to about 10), so the uncapped numbers differ."""
    cap = 3.0
    hidden, weight, targets = _head_inputs(seed=7)
    several = torch.randint(0, VOCAB, (len(hidden), 3), generator=torch.Generator().manual_seed(8))

    def capped(h, w):
        return torch.tanh(h @ w.T / cap) * cap

    for ids in (targets, several):
        coef = torch.linspace(-1.0, 2.0, ids.numel()).view(ids.shape)
        h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got = target_logprobs(h32, w32, ids, 8, temperature, softcap=cap)
        (got * coef).sum().backward()
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        logp = (capped(h64, w64) / temperature).log_softmax(-1)
        want = logp.gather(-1, ids[:, None])[:, 0] if ids.dim() == 1 else logp.gather(-1, ids)
        (want * coef.double()).sum().backward()
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=1e-5)
        assert_grads_match(h32, h64, w32, w64)
        uncapped = target_logprobs(hidden, weight, ids, 8, temperature)
        assert (got.detach() - uncapped).abs().max() > 0.1

    full = capped(hidden.double(), weight.double())
    torch.testing.assert_close(logsumexp_logits(hidden, weight, 8, temperature, softcap=cap).double(),
                               (full / temperature).logsumexp(-1), rtol=0, atol=1e-5)
    values, indices = topk_logits(hidden, weight, 5, 8, softcap=cap)
    want_values, want_indices = full.topk(5, dim=-1)
    torch.testing.assert_close(values.double(), want_values, rtol=0, atol=1e-5)
    assert torch.equal(indices, want_indices)
    inputs = (hidden[:4].double().requires_grad_(), weight.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: target_logprobs(h, w, several[:4], 8, temperature, softcap=cap), inputs)


def test_a_rows_logprob_has_the_same_bits_whatever_the_rows_beside_it():
    """Exact logprobs rest on this: 576 vocabulary rows in chunks of 40 (15 chunks, the zoo's
    BPE vocabularies in the exact-logprob tests), every row count from 64 to 299, each row's
    logprob equal to its value among 300 rows. Combining the chunks' log-sum-exps across the
    rows (a reduction along dim 0) changed the order of the sum with the row count."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(300, 64, generator=g), torch.randn(576, 64, generator=g) * 0.05
    targets = torch.randint(0, 576, (300,), generator=g)
    every = target_logprobs(hidden, weight, targets, 40)
    differ = [n for n in range(64, 300) if not torch.equal(target_logprobs(hidden[:n], weight, targets[:n], 40), every[:n])]
    assert differ == []


def test_logprob_temperature_must_be_positive():
    hidden, weight, targets = _head_inputs()
    with pytest.raises(ValueError, match="logprob temperature must be > 0, got 0.0"):
        target_logprobs(hidden, weight, targets, 8, 0.0)


def test_sequence_logprobs_fill_predicted_positions_and_zero_elsewhere():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    predicted = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    got = sequence_logprobs(hidden, weight, ids, predicted, chunk_size=5)
    full = (hidden[:, :-1].double() @ weight.double().T).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    want = torch.nn.functional.pad(full, (1, 0)) * predicted
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert (got[~predicted] == 0).all()

    several = torch.randint(0, VOCAB, (2, 5, 3), generator=g)  # K = 3 ids per position
    got = sequence_logprobs(hidden, weight, several, predicted, chunk_size=5)
    full = (hidden[:, :-1].double() @ weight.double().T).log_softmax(-1).gather(-1, several[:, 1:])
    want = torch.nn.functional.pad(full, (0, 0, 1, 0)) * predicted[..., None]
    assert got.shape == (2, 5, 3)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("k", "chunk"), [(1, 3), (5, 16), (20, 8), (VOCAB, VOCAB)])
def test_chunked_topk_matches_full_topk(k, chunk):
    hidden, weight, _ = _head_inputs(n=6, seed=2)
    values, indices = topk_logits(hidden, weight, k, chunk)
    want_values, want_indices = (hidden.double() @ weight.double().T).topk(k, dim=-1)
    torch.testing.assert_close(values.double(), want_values, rtol=0, atol=1e-5)
    assert torch.equal(indices, want_indices)


def test_topk_refuses_k_beyond_vocabulary():
    hidden, weight, _ = _head_inputs()
    with pytest.raises(ValueError, match=f"0 < k <= vocabulary size {VOCAB}, got k=38"):
        topk_logits(hidden, weight, VOCAB + 1, 8)


# ---------------------------------------------------------------- packed vs padded rows


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["tiny", "mistral", "gemma2", "gemma3"])
def test_packed_rows_give_padded_logprobs_and_gradients(tiny_model_path, zoo_model, dt, attn, arch):
    """The same model run on padded rows and on packed rows (positions restarting per sample;
    segment attention for sdpa, transformers' own per-layer masks for eager), loaded and run
    the way the worker does (:class:`CausalLMHead`, the logits soft-capped as the model caps
    them): identical logprobs and parameter gradients within 1e-5, and the logprobs of
    transformers' eager float64 forward of each sample alone. The zoo's sliding windows (8
    tokens) bind on the longer samples; Gemma 2 soft-caps attention scores and logits."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_path if arch == "tiny" else zoo_model(arch)
    batch = dt.make_batch()
    kernel = SEGMENT_SDPA if attn == "sdpa" else attn
    model = CausalLMHead(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=kernel))
    softcap = output_softcap(model.lm)
    assert (softcap is not None) == (arch == "gemma2")
    results = []
    for rows in (
        padded_rows(batch["input_ids"], batch["input_lengths"]),
        packed_rows(batch["input_ids"], batch["input_lengths"], 40, round_to=8, attn_implementation=attn),
    ):
        model.zero_grad()
        values = model(rows.input_ids, rows.attention_mask, rows.position_ids,
                       lambda h, w, rows=rows: sequence_logprobs(h, w, rows.input_ids, rows.predicted, 16, softcap=softcap),
                       rows.segment_bounds)
        lp = rows.to_samples(values)
        ((lp * batch["token_mask"]).sum() / batch["token_mask"].sum()).backward()  # the mean token NLL's scale
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, rows))
    (padded_lp, padded_grads, _), (packed_lp, packed_grads, packed) = results
    assert packed.input_ids.shape[0] < len(dt.LENGTHS)  # really packed: fewer rows than samples
    assert packed.input_ids.shape[1] % 8 == 0
    torch.testing.assert_close(packed_lp, padded_lp, rtol=0, atol=1e-5)
    reference = dt.reference_logprobs(dt.reference_model(path), batch)
    torch.testing.assert_close(padded_lp.double() * batch["token_mask"], reference, rtol=0, atol=1e-5)
    assert dt.max_diff(packed_grads, padded_grads) < 1e-5
    assert all(torch.isfinite(g).all() for g in packed_grads.values())


def test_packed_rows_keep_attention_within_each_sample():
    """eager: no mask of ours, positions restarting per sample, from which transformers
    builds each layer's block-diagonal mask (padding, at position 0, sees itself alone)."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 0, 0, 0]])
    rows = packed_rows(ids, torch.tensor([3, 2, 1]), 8, round_to=4, attn_implementation="eager")
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert rows.predicted.tolist() == [[False, True, True, False, True, False, False, False]]
    assert rows.attention_mask is None and rows.segment_bounds is None
    config = LlamaConfig()
    config._attn_implementation = "sdpa"  # boolean masks
    allowed = create_causal_mask(config=config, inputs_embeds=torch.zeros(1, 8, 4), attention_mask=None,
                                 past_key_values=None, position_ids=rows.position_ids)[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False, False, False]  # token 5 sees 4 and itself
    assert allowed[2].tolist() == [True, True, True, False, False, False, False, False]
    assert allowed[7].tolist() == [False] * 7 + [True]
    sdpa = packed_rows(ids, torch.tensor([3, 2, 1]), 4, round_to=4)
    assert sdpa.attention_mask is None and sdpa.input_ids.tolist() == [[1, 2, 3, 6], [4, 5, 0, 0]]
    assert sdpa.segment_bounds.tolist() == [0, 3, 4, 6, 8]  # the second row's padding tail is a segment


def _explicit_attention(q, k, v, allowed, scale, softcap):
    """float64 attention from explicit scores: key/value heads repeated, ``softcap * tanh``
    of the scores when set, -inf where ``allowed`` is False."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)


#: (sliding_window, softcap): none, a window that binds the longer segments, a soft-cap, both.
FEATURES = [(None, None), (4, None), (None, 1.5), (4, 1.5)]


@pytest.mark.parametrize(("window", "softcap"), FEATURES)
@pytest.mark.parametrize(("kv_heads", "value_dim"), [(4, 8), (2, 8), (4, 5)], ids=["mha", "gqa", "narrow_values"])
def test_segment_attention_matches_a_block_diagonal_mask_and_its_gradients(kv_heads, value_dim, window, softcap):
    """Packed rows: every segment attends causally to itself alone, within its sliding window,
    with soft-capped scores, as the explicit float64 computation under the block-diagonal
    mask, gradients included; with grouped-query heads, and with values narrower than queries
    and keys (multi-head latent attention: DeepSeek-V3)."""
    g = torch.Generator().manual_seed(0)
    lengths, width = [[5, 2, 6, 3], [9, 4]], 16  # the first row is full, the second has 3 padding tokens
    q, k, v = (torch.randn(2, n, width, d, generator=g, dtype=torch.float64, requires_grad=True)
               for n, d in ((4, 8), (kv_heads, 8), (kv_heads, value_dim)))
    seg = torch.full((2, width), -1)
    pos = torch.zeros((2, width), dtype=torch.long)
    bounds = [0]
    for r, row in enumerate(lengths):
        offset = 0
        for s, n in enumerate(row):
            seg[r, offset:offset + n] = s
            pos[r, offset:offset + n] = torch.arange(n)
            offset += n
            bounds.append(r * width + offset)
        if offset < width:
            bounds.append((r + 1) * width)
    same = (seg[:, :, None] == seg[:, None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    if window is not None:
        same &= pos[:, :, None] - pos[:, None, :] < window
    grad = torch.randn(2, width, 4, value_dim, generator=g, dtype=torch.float64) * (seg >= 0)[:, :, None, None]
    got, weights = segment_sdpa(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32),
                                sliding_window=window, softcap=softcap)
    got_grads = torch.autograd.grad((got * grad).sum(), (q, k, v))
    want = _explicit_attention(q, k, v, same[:, None], 0.3, softcap)
    want_grads = torch.autograd.grad((want * grad).sum(), (q, k, v))
    real = (seg >= 0)[:, :, None, None]
    assert weights is None and got.shape == (2, width, 4, value_dim)
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_packed_pass_reads_its_segment_bounds_once():
    """Every layer of a pass, and the recomputation of checkpointed layers, gets the same bounds
    tensor: its plan is made at the first layer (reading the bounds waits for a GPU) and reused;
    other bounds and another spread get plans of their own, alike for alike bounds."""
    bounds, cpu = torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32), torch.device("cpu")
    first = segment_plan(bounds, 2, 8, 1.5, cpu)
    assert segment_plan(bounds, 2, 8, 1.5, cpu) is first
    copy = segment_plan(bounds.clone(), 2, 8, 1.5, cpu)
    assert copy is not first and [(b.count, b.longest, b.index.tolist(), b.real.tolist()) for b in copy] == [
        (b.count, b.longest, b.index.tolist(), b.real.tolist()) for b in first]
    assert [b.count for b in first] == [2, 2] and [b.count for b in segment_plan(bounds, 2, 8, 1.0, cpu)] == [1, 1, 1, 1]
    assert segment_plan(bounds, 2, 8, 1.5, cpu) is not first  # the last plan made was for spread 1.0


@pytest.mark.parametrize(("window", "softcap"), FEATURES)
def test_segment_attention_without_bounds_runs_each_row_causally_within_its_window(window, softcap):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, n, 11, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    allowed = torch.ones(11, 11, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.arange(11)[:, None] - torch.arange(11)[None, :] < window
    got, _ = segment_sdpa(None, q, k, v, None, scaling=0.3, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got, _explicit_attention(q, k, v, allowed, 0.3, softcap), rtol=0, atol=1e-12)


def test_segment_attention_refuses_masks_and_bad_bounds():
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="takes segment bounds \\(cu_seq_lens_q\\), not an attention mask"):
        segment_sdpa(None, q, q, q, torch.ones(2, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must run from 0 to rows x width = 8, got \[0, 4, 6\]"):
        segment_sdpa(None, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 4, 6]))
    with pytest.raises(ValueError, match=r"segment \[2, 6\) of cu_seq_lens_q is empty or crosses the end of row 0"):
        segment_sdpa(None, q, q, q, None, cu_seq_lens_q=torch.tensor([0, 2, 6, 8]))


def test_packing_refuses_an_attention_kernel_that_cannot_keep_samples_apart():
    with pytest.raises(ValueError, match="sdpa and eager; got 'flash_attention_2'"):
        packed_rows(torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2]), 8, attn_implementation="flash_attention_2")


def test_loss_positions_exclude_first_token_padding_and_masked_tokens():
    keep = loss_positions(torch.tensor([3, 4]), 5, torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]))
    assert keep.tolist() == [[False, True, True, False, False], [False, False, True, True, False]]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_head_runs_on_the_reported_positions_alone(dt, layout):
    """The positions a microbatch's rows send through the head are those whose logprob is
    reported: the prompt's tokens (``token_mask`` 0) cost no head work."""
    batch = dt.make_batch()
    ids, lengths, mask = batch["input_ids"], batch["input_lengths"], batch["token_mask"]
    rows = padded_rows(ids, lengths) if layout == "padded" else packed_rows(ids, lengths, 40, round_to=8)
    scored = rows.scored(mask)
    keep = loss_positions(lengths, rows.width, mask)
    assert torch.equal(rows.to_samples(scored.long()).bool(), keep)
    assert int(scored.sum()) == int(keep.sum()) == int(rows.predicted.sum()) - (dt.PROMPT - 1) * len(dt.LENGTHS)
    assert torch.equal(rows.scored(None), rows.predicted)


# ---------------------------------------------------------------- planning


def _check_plan(plan, lengths, dp):
    assert sorted(i for shard in plan.shards for i in shard) == list(range(len(lengths)))
    assert len({len(mbs) for mbs in plan.microbatches}) == 1  # same microbatch count on every rank
    for shard, mbs in zip(plan.shards, plan.microbatches, strict=True):
        assert sorted(i for mb in mbs for i in mb) == list(range(len(shard)))


def test_fixed_plan_is_contiguous_microbatches_in_order():
    plan = plan_pass([3] * 8, 2, Batching(micro_batch_size=3))
    assert plan.shards == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.microbatches == [[[0, 1, 2], [3]], [[0, 1, 2], [3]]]


def test_packing_plan_fills_rows_within_budget_and_balances_ranks():
    lengths = [30, 2, 3, 28, 5, 4, 31, 1]
    plan = plan_pass(lengths, 2, Batching(micro_batch_size=1, packing_tokens_per_row=32))
    _check_plan(plan, lengths, 2)
    for shard, mbs in zip(plan.shards, plan.microbatches, strict=True):
        for mb in mbs:
            assert sum(lengths[shard[i]] for i in mb) <= 32
    tokens = [sum(lengths[i] for i in shard) for shard in plan.shards]
    assert abs(tokens[0] - tokens[1]) <= max(lengths)


def test_dynamic_plan_respects_token_budget_with_equal_counts():
    lengths = [30, 2, 3, 28, 5, 4, 31, 1, 7, 9]
    plan = plan_pass(lengths, 2, Batching(micro_batch_size=1, dynamic_max_tokens=40, round_to=4))
    _check_plan(plan, lengths, 2)
    for shard, mbs in zip(plan.shards, plan.microbatches, strict=True):
        for mb in mbs:
            width = -(-max(lengths[shard[i]] for i in mb) // 4) * 4
            assert len(mb) == 1 or len(mb) * width <= 40


def test_batching_refuses_packing_and_dynamic_together():
    with pytest.raises(ValueError, match="exclusive"):
        Batching(micro_batch_size=1, packing_tokens_per_row=8, dynamic_max_tokens=8)


# ---------------------------------------------------------------- optimizer, schedule, counts


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    cos = SchedulerConfig(name="cosine", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, cos) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(14, cos) == pytest.approx(0.1) and lr_factor(40, cos) == pytest.approx(0.1)
    lin = SchedulerConfig(name="linear", warmup_steps=0, total_steps=10)
    assert [lr_factor(s, lin) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr_factor(1000, SchedulerConfig(name="constant", warmup_steps=2)) == 1.0


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([param], OptimizerConfig(lr=2.0))
    sched = build_scheduler(opt, SchedulerConfig(name="linear", warmup_steps=2, total_steps=6))
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0])


def test_decaying_schedule_without_horizon_names_the_key():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match="policy.scheduler.total_steps is needed by the 'cosine' schedule"):
        build_scheduler(opt, SchedulerConfig(name="cosine"))
    with pytest.raises(ConfigError, match="policy.scheduler.name: expected one of constant, linear, cosine, got 'step'"):
        build_scheduler(opt, SchedulerConfig(name="step"))


def test_grad_norm_of_plain_tensors_is_the_global_l2_norm():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(1))]
    params[0].grad = torch.tensor([3.0, 0.0, 4.0])
    params[1].grad = torch.full((2, 2), 6.0)
    assert float(total_grad_norm(params)) == pytest.approx(math.sqrt(9 + 16 + 4 * 36))


def test_clipping_scales_gradients_to_the_max_norm_only_when_above():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    clip_grads_(params, 1.0, total_grad_norm(params))
    assert float(total_grad_norm(params)) == pytest.approx(1.0, rel=1e-5)
    assert params[0].grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5)
    clip_grads_(params, 10.0, total_grad_norm(params))
    assert params[1].grad.tolist() == pytest.approx([0.8], rel=1e-5)


def test_unknown_optimizer_names_the_key():
    with pytest.raises(ConfigError, match="policy.optimizer.name: expected one of adamw, adam, sgd, muon, got 'lion'"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerConfig(name="lion"))


def test_global_valid_counts_use_token_and_sample_masks(dt):
    batch = dt.make_batch()
    seqs, toks = global_valid_counts(batch, None)
    lens = torch.tensor(dt.LENGTHS)
    want_tokens = sum(int(n) - 2 for i, n in enumerate(lens) if i != 6)
    assert float(seqs) == len(dt.LENGTHS) - 1
    assert float(toks) == want_tokens


def test_bucket_names_bound_bucket_bytes_and_isolate_oversized_tensors():
    sizes = [("a", 40), ("b", 50), ("c", 30), ("big", 500), ("d", 10), ("e", 95)]
    assert bucket_names(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"], ["e"]]
    assert bucket_names(sizes, 1000) == [["a", "b", "c", "big", "d", "e"]]


# ---------------------------------------------------------------- config validation


def test_validation_names_the_keys(dt):
    cfg = dt.policy_config("/nowhere")
    cfg.policy.sequence_packing.enabled = cfg.policy.dynamic_batching.enabled = True
    with pytest.raises(ConfigError, match="sequence_packing.enabled and policy.dynamic_batching.enabled are both true"):
        validate_policy_config(cfg)
    cfg = dt.policy_config("/nowhere", dtype="half")
    with pytest.raises(ConfigError, match="policy.dtype: expected one of float32, bfloat16, float16, got 'half'"):
        validate_policy_config(cfg)
    cfg = dt.policy_config("/nowhere", dtensor=DTensorConfig(attn_implementation="flash_attention_2"))
    validate_policy_config(cfg)  # fine without packing
    cfg.policy.sequence_packing.enabled = True
    with pytest.raises(ConfigError, match="policy.dtensor.attn_implementation in sdpa, eager .* got 'flash_attention_2'"):
        validate_policy_config(cfg)


def test_validate_hook_checks_only_dtensor_policies(dt):
    from posttrain.plugins import plugin_host

    cfg = dt.policy_config("/nowhere")
    cfg.policy.sequence_packing.enabled = cfg.policy.dynamic_batching.enabled = True
    with pytest.raises(ConfigError, match="both true"):
        plugin_host().hook.posttrain_validate_config(config=cfg)
    cfg.policy.backend = "not_dtensor"  # a backend no installed plugin checks
    plugin_host().hook.posttrain_validate_config(config=cfg)  # another backend's business
