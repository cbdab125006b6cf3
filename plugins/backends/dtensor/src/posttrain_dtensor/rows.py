"""How a microbatch of right-padded samples becomes the rows the model runs on, and back.

Two layouts, same results (up to rounding):

- padded: one sample per row, trimmed to the microbatch's longest sample, with a 2-D
  padding mask (Hugging Face builds the causal mask from it);
- packed: several samples end to end per row (:func:`posttrain.batch.pack_sequences`),
  positions restarting at 0 for every sample, so no token sees another sample: with the
  ``sdpa`` kernel, segment bounds for :mod:`posttrain_dtensor.segment_attention` (causal
  within each sample, no mask); with ``eager``, no mask at all: Hugging Face then reads the
  samples off the restarting positions (transformers 5.18 ``masking_utils``, packed
  sequences) and builds each layer's block-diagonal causal mask itself, a sliding window
  included where the layer has one (a 4-D mask of ours would reach every layer unchanged,
  dropping the windows). Each padding position (position 0) is a sample of its own, so it
  sees itself: a query with no allowed key would produce NaN.

For exact logprobs, a third (:func:`exact_rows`): every turn's scoring prefix
(:mod:`posttrain.backend.exact`) packed end to end in one row, each prefix a segment of its
own; the same bits whatever the microbatch holds.
"""

from __future__ import annotations

import attrs
import torch

from posttrain.backend.exact import MIN_ROWS, generated_spans
from posttrain.batch import PackedRows, pack_sequences
from posttrain_dtensor.config import PACKING_ATTENTION


@attrs.frozen
class PrefixFold:
    """The way back from exact rows for ``num_samples`` samples: segment ``k`` is a prefix of
    sample ``samples[k]`` whose positions ``starts[k]`` to ``ends[k] - 1`` are the tokens it scores."""

    num_samples: int
    samples: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    def fold(self, segments: torch.Tensor, width: int) -> torch.Tensor:
        """Per-segment values [K, L, ...] onto per-sample [num_samples, width, ...], each
        segment's scored positions only (zero elsewhere); differentiable."""
        parts = [(torch.full((e - s,), k), torch.full((e - s,), i), torch.arange(s, e))
                 for k, (i, s, e) in enumerate(zip(self.samples, self.starts, self.ends, strict=True))]
        segment, sample, position = (torch.cat(column).to(segments.device) for column in zip(*parts, strict=True))
        out = segments.new_zeros((self.num_samples, width, *segments.shape[2:]))
        return out.index_put((sample, position), segments[segment, position])


@attrs.frozen
class ModelRows:
    """Inputs for one forward pass plus the way back to per-sample tensors.

    ``predicted`` [R, T] is True where the token at ``t`` is predicted from ``t - 1`` of the
    same sample; ``valid`` [R, T] is True on every real (non-padding) token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    predicted: torch.Tensor
    valid: torch.Tensor
    width: int  # per-sample width to restore
    packed: PackedRows | None = None
    segment_bounds: torch.Tensor | None = None  # cu_seqlens of packed rows for segment attention
    prefixes: PrefixFold | None = None  # exact rows: the packed segments are scoring prefixes

    def to_samples(self, values: torch.Tensor) -> torch.Tensor:
        """Row-layout [R, T, ...] values back to per-sample [B, width, ...], zero-padded (exact
        rows: each position from the prefix that scores it, zero where none does)."""
        if self.prefixes is not None:
            assert self.packed is not None
            segments = self.packed.unpack(values, max(self.packed.lengths))
            return self.prefixes.fold(segments, self.width)
        if self.packed is not None:
            return self.packed.unpack(values, self.width)
        pad = self.width - values.shape[1]
        return torch.nn.functional.pad(values, (0, 0) * (values.dim() - 2) + (0, pad)) if pad else values

    def lay_out(self, values: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """A per-sample [B, S, ...] tensor laid out like ``input_ids`` ([R, T, ...]), ``pad_value``
        where no token is (padded and packed rows; not exact rows)."""
        if self.prefixes is not None:
            raise ValueError("exact rows score prefixes of samples; per-token values cannot be laid out on them")
        if self.packed is not None:
            return self.packed.pack(values, pad_value)
        return values[:, :self.input_ids.shape[1]]

    def scored(self, token_mask: torch.Tensor | None) -> torch.Tensor:
        """Bool [R, T]: the positions whose logprob is reported, ``predicted`` and, where given,
        ``token_mask`` [B, S] (per sample) laid out on the rows. Only these go through the
        language-model head: a prompt's tokens cost no head work (exact rows score their
        masked tokens already)."""
        if token_mask is None or self.prefixes is not None:
            return self.predicted
        return self.predicted & self.lay_out(token_mask.to(self.predicted.device, torch.bool), False)

    def to(self, device: torch.device) -> ModelRows:
        move = {f.name: getattr(self, f.name).to(device) for f in attrs.fields(ModelRows)
                if isinstance(getattr(self, f.name), torch.Tensor)}
        return attrs.evolve(self, **move)


def padded_rows(input_ids: torch.Tensor, lengths: torch.Tensor) -> ModelRows:
    """One sample per row, trimmed to the longest sample of the microbatch."""
    width = input_ids.shape[1]
    longest = int(lengths.max())
    positions = torch.arange(longest)
    valid = positions[None, :] < lengths[:, None]
    return ModelRows(
        input_ids=input_ids[:, :longest],
        attention_mask=valid.long(),
        position_ids=None,
        predicted=valid & (positions[None, :] >= 1),
        valid=valid,
        width=width,
    )


def packed_rows(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    max_tokens_per_row: int,
    *,
    round_to: int = 1,
    attn_implementation: str = "sdpa",
) -> ModelRows:
    """Samples packed end to end into rows of at most ``max_tokens_per_row`` tokens: segment
    bounds for ``sdpa`` (run as :data:`~posttrain_dtensor.segment_attention.SEGMENT_SDPA`),
    the restarting positions alone for ``eager``.
    """
    if attn_implementation not in PACKING_ATTENTION:
        raise ValueError(
            f"sequence packing keeps samples apart for attn_implementation "
            f"{' and '.join(PACKING_ATTENTION)}; got '{attn_implementation}'"
        )
    packed = pack_sequences(input_ids, lengths, max_tokens_per_row, round_to=round_to)
    seg = packed.segment_ids
    bounds = packed.segment_bounds() if attn_implementation == "sdpa" else None
    predicted = torch.zeros_like(seg, dtype=torch.bool)
    predicted[:, 1:] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    return ModelRows(
        input_ids=packed.input_ids,
        attention_mask=None,
        position_ids=packed.position_ids,
        predicted=predicted,
        valid=seg >= 0,
        width=input_ids.shape[1],
        packed=packed,
        segment_bounds=bounds,
    )


def exact_rows(input_ids: torch.Tensor, lengths: torch.Tensor, token_mask: torch.Tensor | None) -> ModelRows:
    """The scoring prefixes of every turn of every sample (runs of ``token_mask``; without a
    mask, each sample is one turn of all its tokens but the first) packed end to end in one row
    of at least :data:`~posttrain.backend.exact.MIN_ROWS` tokens, each prefix a segment of its
    own (run as :data:`~posttrain_dtensor.segment_attention.EXACT_SEGMENT_SDPA`); ``predicted``
    is True exactly on the tokens each prefix scores. A microbatch without generated tokens
    scores nothing (its first sample runs as one segment)."""
    spans = []
    for i, n in enumerate(lengths.tolist()):
        turns = generated_spans(token_mask[i], n) if token_mask is not None else [(1, n)]
        spans += [(i, max(start, 1), end) for start, end in turns if max(start, 1) < end]
    if not spans:
        spans = [(0, 1, 1)]
    ends = torch.tensor([end for _, _, end in spans])
    prefixes = torch.stack([torch.nn.functional.pad(input_ids[i, :end], (0, int(ends.max()) - end)) for i, _, end in spans])
    packed = pack_sequences(prefixes, ends, int(ends.sum()), round_to=MIN_ROWS)
    scored = torch.zeros(prefixes.shape, dtype=torch.bool)
    for k, (_, start, end) in enumerate(spans):
        scored[k, start:end] = True
    return ModelRows(
        input_ids=packed.input_ids,
        attention_mask=None,
        position_ids=packed.position_ids,
        predicted=packed.pack(scored, False),
        valid=packed.segment_ids >= 0,
        width=input_ids.shape[1],
        packed=packed,
        segment_bounds=packed.segment_bounds(),
        prefixes=PrefixFold(len(lengths), *(tuple(column) for column in zip(*spans, strict=True))),
    )


def microbatch_rows(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    *,
    packing_tokens_per_row: int | None,
    round_to: int = 1,
    attn_implementation: str = "sdpa",
) -> ModelRows:
    """Packed rows when ``packing_tokens_per_row`` is set, padded rows otherwise."""
    if packing_tokens_per_row is None:
        return padded_rows(input_ids, lengths)
    return packed_rows(input_ids, lengths, packing_tokens_per_row, round_to=round_to,
                       attn_implementation=attn_implementation)

