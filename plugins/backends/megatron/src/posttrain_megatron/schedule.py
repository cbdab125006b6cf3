"""Running a rank's microbatches through megatron-core's schedules.

One path for every layout: megatron-core's ``get_forward_backward_func()`` picks the plain
loop (pipeline size 1) or the 1F1B pipeline schedule, which sends activations between
stages and runs ``on_last_stage`` on the last one. Losses reach the schedule already
normalised by posttrain's global token / sequence counts
(``calculate_per_token_loss=True``: no division by microbatch count), and after the last
backward the schedule calls :func:`finalize_grads`, which reduces gradients over
data-parallel (and context-parallel) ranks as a sum, all-reduces layer-norm gradients
under sequence parallelism and tied embedding gradients between the first and last
pipeline stages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from posttrain.batch import Batch
from posttrain_megatron.head import Rows


@attrs.frozen
class Microbatch:
    """A microbatch's samples (on CPU), its model rows (on the device) and, with routing replay
    (``policy.moe``), the routes its routers are given ([tokens, MoE layers, k], in their order)."""

    batch: Batch
    rows: Rows
    routes: torch.Tensor | None = None


#: ``(hidden states [s, b, h] of the last stage, microbatch) -> (loss, report)``; the loss
#: is a scalar (0 for forward-only passes), the report any picklable values.
LastStage = Callable[[torch.Tensor, Microbatch], tuple[torch.Tensor, dict[str, Any]]]


def finalize_grads(models: list[torch.nn.Module], num_tokens: torch.Tensor | None = None, **kwargs: Any) -> None:
    """megatron-core's gradient finalisation without its division by the token count
    (posttrain's losses are already divided by the global count)."""
    finalize_model_grads(models, None, **kwargs)


def run_microbatches(
    model: torch.nn.Module, microbatches: Sequence[Microbatch], on_last_stage: LastStage, *, forward_only: bool,
    before_forward: Callable[[Microbatch], None] | None = None,
) -> list[dict[str, Any]]:
    """Forward (and unless ``forward_only``, backward) every microbatch; return the last
    stage's reports in microbatch order (an empty list on other stages). ``before_forward``
    runs before each microbatch's forward on this stage."""

    def forward_step(data_iterator, model):
        mb: Microbatch = next(data_iterator)
        if before_forward is not None:
            before_forward(mb)
        ids = mb.rows.input_ids
        positions = mb.rows.positions.to(ids.device)[None, :].expand_as(ids)
        hidden = model(ids, positions, None)
        return hidden, functools.partial(_loss, mb)

    def _loss(mb: Microbatch, hidden: torch.Tensor):
        loss, report = on_last_stage(hidden, mb)
        return loss, torch.zeros((), dtype=torch.int, device=loss.device), report

    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=max(mb.rows.input_ids.shape[1] for mb in microbatches),  # unused: variable_seq_lengths
        micro_batch_size=max(mb.rows.input_ids.shape[0] for mb in microbatches),
        forward_only=forward_only,
    )
