"""Where a train/inference mismatch comes from: ``token_mult_prob_error`` and ``mismatch_kl``
per assistant turn, per position bucket and, in asynchronous runs, per staleness.

A token's turn is its sample's run of generated tokens it belongs to (``token_mask``), counted
from 1: ``mismatch/turn_<k>/...``. Its position bucket holds its position in the sequence:
``mismatch/pos_0_63/...``, then buckets doubling in width (``pos_64_127``, ``pos_128_255``, ...).
Its staleness is how many versions the weights that generated it lag the weights being
trained (batch fields ``generation_versions`` and ``trained_version``, given by asynchronous
GRPO): ``mismatch/staleness_<k>/...``. Tokens of staleness 0 were sampled by the weights being
trained, so their gap is the engine's alone; older tokens add the policy's drift since.
Within a bucket both metrics are means over its valid tokens (token means, whatever
``token_level_loss``), and ``mismatch/<bucket>/token_share`` is its share of the valid tokens.

The loss (:func:`bucket_sums`) reports, like all its metrics, contributions that sum over
microbatches and data-parallel ranks: each bucket's sums divided by the global token count. A
training pass's combined metrics become means with :func:`mismatch_means`, which also divides
the pass's ``token_mult_prob_error`` by the share it covers: when the engine's logprobs are the
trainer's, every token contributes exactly what its share does, and the metric is exactly 1
(the shares of several microbatches, each rounded, need not sum to exactly 1).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from posttrain.batch import Batch
from posttrain_grpo.importance import MISMATCH_SHARE
from posttrain_grpo.reduction import Reduction

PREFIX = "mismatch/"
SHARE = "token_share"
#: Width of the first position bucket; each next one is as wide as everything before it.
FIRST_BUCKET = 64


def turn_index(token_mask: torch.Tensor) -> torch.Tensor:
    """int64 [b, S]: the turn (1, 2, ...) of each generated token, its row's run of
    ``token_mask`` > 0 counted from the left; 0 off the generated tokens."""
    on = token_mask > 0
    starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0))
    return torch.where(on, starts.long().cumsum(dim=1), 0)


def position_bucket(width: int) -> torch.Tensor:
    """int64 [width]: the bucket of each position: 0 for ``[0, 64)``, then ``k`` for
    ``[64 * 2**(k-1), 64 * 2**k)``."""
    t = torch.arange(width)
    return torch.where(t < FIRST_BUCKET, 0, torch.log2(t.clamp(min=1) / FIRST_BUCKET).floor().long() + 1)


def bucket_name(k: int) -> str:
    """``pos_<first>_<last>`` of position bucket ``k``."""
    first = 0 if k == 0 else FIRST_BUCKET << (k - 1)
    return f"pos_{first}_{(FIRST_BUCKET << k) - 1}"


def bucket_sums(prev: torch.Tensor, gen: torch.Tensor, reduce: Reduction, batch: Batch) -> dict[str, torch.Tensor]:
    """Per turn, position bucket and (with the batch's ``generation_versions`` and
    ``trained_version``) staleness of the valid tokens of ``prev`` and ``gen`` ([b, S], the
    trainer's and the engine's logprobs): the sums of ``exp(|d|)`` and ``e^d - 1 - d``
    (``d = prev - gen``) and the token count, each divided by the global valid token count."""
    valid = reduce.valid
    d = torch.where(valid, prev - gen, 0.0).detach()
    wide = d.double()  # as mismatch_kl (posttrain_grpo.importance.mismatch_metrics)
    per_token = {"token_mult_prob_error": torch.exp(d.abs()), "mismatch_kl": torch.exp(wide) - 1 - wide}
    groups = {}
    for name, index in (("turn", turn_index(reduce.token_mask)), ("staleness", _staleness(batch, valid))):
        if index is not None:
            groups.update({f"{name}_{k}": index == k for k in index[valid].unique().tolist()})
    buckets = position_bucket(valid.shape[1]).to(valid.device)[None, :].expand_as(valid)
    groups.update({bucket_name(k): buckets == k for k in buckets[valid].unique().tolist()})
    out = {}
    for group, members in groups.items():
        members = members & valid
        out[f"{PREFIX}{group}/{SHARE}"] = members.sum() / reduce.tok_count
        for name, values in per_token.items():
            out[f"{PREFIX}{group}/{name}"] = torch.where(members, values, 0.0).sum() / reduce.tok_count
    return out


def _staleness(batch: Batch, like: torch.Tensor) -> torch.Tensor | None:
    """int64 [b, S]: versions each token's weights lag ``trained_version``; None without the fields."""
    if "generation_versions" not in batch or "trained_version" not in batch:
        return None
    return (batch["trained_version"][:, None] - batch["generation_versions"]).to(like.device)


def mismatch_means(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` of a training pass with each bucket's summed contributions
    (:func:`bucket_sums`, combined over the pass) turned into means over the bucket's tokens,
    and ``token_mult_prob_error`` divided by ``mismatch/share`` (which is dropped)."""
    out = dict(metrics)
    share = out.pop(MISMATCH_SHARE, None)
    if share and "token_mult_prob_error" in out:
        out["token_mult_prob_error"] /= share
    for name, value in metrics.items():
        if not name.startswith(PREFIX) or name.endswith(f"/{SHARE}") or name == MISMATCH_SHARE:
            continue
        share = metrics.get(f"{name.rsplit('/', 1)[0]}/{SHARE}")
        if share:
            out[name] = value / share
    return out
