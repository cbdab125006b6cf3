"""Loss functions: how a batch's logprobs become a scalar to minimise.

Global normalisation: the policy counts valid tokens (``token_mask * sample_mask``) and
valid sequences over the *whole global batch* before training, and passes those counts to
every microbatch call. Each call divides by the global counts, and the policy sums the
microbatch losses, so gradient accumulation equals one full-batch step exactly.

Metrics are combined the same way (summed over microbatches and ranks), except those a loss
names in ``metric_reductions`` (extremes such as ``ratio_max``); :func:`combine_metrics`
does both, and combines the results of several passes too.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from posttrain.batch import Batch


class LossType(enum.Enum):
    TOKEN = "token"  # normalised by the global number of valid tokens
    SEQUENCE = "sequence"  # normalised by the global number of valid sequences


class LossFunction(abc.ABC):
    """A loss over the policy's per-position outputs: next-token logprobs, or the values of
    a model with a value head (see :attr:`input_type`)."""

    loss_type: LossType = LossType.TOKEN

    #: What the policy passes as the loss's first argument:
    #:
    #: - ``"logprobs"``: the next-token logprobs [b, S] (``policy.head`` ``lm``);
    #: - ``"topk_logprobs"``: float32 [b, S, k], the logprobs of ``k`` given token ids at every
    #:   position (``policy.head`` ``lm``): ``out[:, t, j] = log p(topk_indices[:, t - 1, j] | x_<t)``
    #:   for ``1 <= t < length`` where ``token_mask`` is 1, 0 elsewhere, with ``topk_indices``
    #:   int64 [b, S-1, k] a batch field laid out as :meth:`~posttrain.interfaces.Policy.get_topk_logits`
    #:   gives it (a teacher's top-k, for distillation); computed in the policy's workers, so no
    #:   [tokens, vocabulary] tensor leaves them;
    #: - ``"values"``: the value head's output [b, S] at every position ``0 <= t < length``, 0 on
    #:   padding (``policy.head`` ``value``).
    #:
    #: A policy refuses a loss whose input its backend does not compute or its head does not give.
    input_type: ClassVar[Literal["logprobs", "topk_logprobs", "values"]] = "logprobs"

    #: Consecutive rows that form one example and must stay together, in order, in one
    #: microbatch on one data-parallel rank (DPO: 2, a chosen row then its rejected row).
    #: Policy backends shard, microbatch and pack whole groups of this many rows.
    row_group_size: ClassVar[int] = 1

    #: Metrics combined by ``max`` or ``min`` instead of summed, e.g. ``{"ratio_max": "max"}``.
    #: A microbatch without valid tokens reports -inf for a max and +inf for a min.
    metric_reductions: ClassVar[Mapping[str, Literal["max", "min"]]] = {}

    @abc.abstractmethod
    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: Batch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)`` for one microbatch.

        ``logprobs`` float32 [b, S] holds the current weights' next-token logprobs in the
        policy's convention, with gradient (or, by :attr:`input_type`, the top-k logprobs or
        the value head's outputs, with gradient). ``batch`` is the microbatch (same rows).
        ``global_valid_seqs`` and ``global_valid_toks`` are scalar tensors over the global
        batch. Each metric is a contribution that sums to its global value over all
        microbatches and ranks (normalise metrics the same way as the loss), except those
        named in :attr:`metric_reductions`.
        """


Reduction = Literal["sum", "mean", "max", "min"]


def combine_metrics(
    parts: Sequence[Mapping[str, float]],
    reductions: Mapping[str, str],
    *,
    default: Reduction = "sum",
    weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """One value per metric name from the metrics several parts reported, names in the
    order first seen. The one combiner of posttrain: microbatches and ranks of a pass, the
    passes of an algorithm step, the batches of a validation.

    A name is reduced by ``reductions.get(name, default)``, over the parts that report it:

    - ``"sum"``: contributions that add up to the whole (a loss's metrics, normalised by
      global counts, over microbatches and ranks; token counts; seconds);
    - ``"mean"``: the mean of per-part values, each part weighted by ``weights[i]`` when
      given (e.g. each validation batch's normaliser), equally otherwise;
    - ``"max"`` / ``"min"``: extremes (a loss's :attr:`LossFunction.metric_reductions`).
    """
    if weights is not None and len(weights) != len(parts):
        raise ValueError(f"combine_metrics: {len(weights)} weights for {len(parts)} parts")
    out = {}
    for name in dict.fromkeys(name for part in parts for name in part):
        present = [(i, float(part[name])) for i, part in enumerate(parts) if name in part]
        values = [value for _, value in present]
        kind = reductions.get(name, default)
        if kind == "max":
            out[name] = max(values)
        elif kind == "min":
            out[name] = min(values)
        elif kind == "sum":
            out[name] = sum(values)
        elif kind != "mean":
            raise ValueError(f"combine_metrics: unknown reduction '{kind}' for '{name}'; expected sum, mean, max or min")
        elif weights is None:
            out[name] = sum(values) / len(values)
        else:
            out[name] = sum(weights[i] * value for i, value in present) / sum(weights[i] for i, _ in present)
    return out


def global_valid_counts(
    batch: Batch, group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid sequences (``sum(sample_mask)``) and valid tokens (``sum(token_mask *
    sample_mask)``) of this rank's samples, summed over ``group`` (the data-parallel ranks),
    as float32 scalars on ``device``. ``sample_mask`` defaults to all ones. The reduction
    runs on ``device``: pass the device the group's backend serves (CUDA for an NCCL group,
    which cannot reduce CPU tensors; the CPU for gloo)."""
    token_mask = batch["token_mask"].double()
    sample_mask = batch["sample_mask"].double() if "sample_mask" in batch else torch.ones(len(batch), dtype=torch.float64)
    counts = torch.stack([sample_mask.sum(), (token_mask * sample_mask[:, None]).sum()]).to(device)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return counts[0].float(), counts[1].float()


def check_pair_rows(rows: int, needs: str) -> None:
    """Refuse a microbatch of ``rows`` rows that cannot hold whole chosen/rejected pairs
    (the ``preference`` layout: chosen at even rows, rejected at odd rows); ``needs``
    begins the message, e.g. ``"DPO needs"``."""
    if rows % 2:
        raise ValueError(
            f"{needs} chosen/rejected pairs (chosen at even rows, rejected at odd rows); got a microbatch of {rows} "
            f"rows. Use an even micro batch size."
        )
