"""The ``dpo`` config section: the supervised loop's options plus the DPO loss options."""

from __future__ import annotations

from typing import Any

import attrs

from posttrain.config.validate import BatchSizeRules, where_set
from posttrain.run.supervised_config import SupervisedConfig, check_supervised_config

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "bco_pair", "apo_zero", "apo_down", "sppo_hard", "sft")
SFT_REDUCTIONS = ("mean", "sum")
#: Loss types whose formula reads label_smoothing.
SMOOTHED_LOSS_TYPES = ("sigmoid", "robust")


@attrs.define
class DPOConfig(SupervisedConfig):
    """Options of the ``dpo`` algorithm: the supervised loop's
    (:class:`~posttrain.run.supervised_config.SupervisedConfig`) and its loss's (see
    :class:`posttrain_dpo.loss.DPOLoss`)."""

    beta: float = 0.1  # strength of the pull towards the reference policy
    # sigmoid | ipo | hinge | robust | bco_pair | apo_zero | apo_down | sppo_hard (TRL's formulas) | sft (the
    # SFT term alone); formulas in docs/algorithms/loss-reference.md
    loss_type: str = "sigmoid"
    reference_free: bool = False  # compare chosen and rejected without a reference policy
    average_log_probs: bool = False  # length-normalise sequence logprobs (TRL's ipo always does: set it with ipo)
    sft_weight: float = 0.0  # weight of the NLL of the chosen responses added to the loss
    # the chosen response's NLL in the SFT term: mean per token, or sum over its tokens (NeMo RL's default)
    sft_reduction: str = "mean"
    # sigmoid (conservative DPO; TRL ignores it there) and robust only: assumed probability that a label is flipped
    label_smoothing: float = 0.0
    loss: str = "dpo"

    def batch_size_rules(self) -> BatchSizeRules:
        """Batch sizes count rows, a chosen and a rejected row per pair: core keeps whole
        pairs in every microbatch (and so on every data-parallel rank)."""
        return BatchSizeRules(micro_multiple=2, micro_reason="whole chosen/rejected pairs of rows")


def check_options(options: DPOConfig) -> list[str]:
    """Problems with the ``dpo`` section, each naming its key, what was expected and what was found."""
    problems = check_supervised_config("dpo", options)
    if options.loss_type not in LOSS_TYPES:
        problems.append(f"dpo.loss_type: expected one of {', '.join(LOSS_TYPES)}, found '{options.loss_type}'")
    if not options.beta > 0:
        problems.append(f"dpo.beta: expected a positive number, found {options.beta}")
    if options.sft_weight < 0:
        problems.append(f"dpo.sft_weight: expected 0 or more, found {options.sft_weight}")
    if options.sft_reduction not in SFT_REDUCTIONS:
        problems.append(
            f"dpo.sft_reduction: expected one of {', '.join(SFT_REDUCTIONS)}, found '{options.sft_reduction}'"
        )
    if options.loss_type == "sft" and options.sft_weight:
        problems.append(
            f"dpo.sft_weight: loss_type sft is the SFT term alone, with weight 1, so dpo.sft_weight "
            f"({options.sft_weight}) would be ignored; remove dpo.sft_weight or choose a preference loss_type"
        )
    if not 0 <= options.label_smoothing < 0.5:
        problems.append(f"dpo.label_smoothing: expected a value in [0, 0.5), found {options.label_smoothing}")
    elif options.label_smoothing and options.loss_type not in SMOOTHED_LOSS_TYPES:
        problems.append(
            f"dpo.label_smoothing: applies to loss_type {' and '.join(SMOOTHED_LOSS_TYPES)} only, found "
            f"dpo.loss_type '{options.loss_type}'; remove dpo.label_smoothing"
        )
    return problems


def check_pair_batching(config: Any, options: DPOConfig) -> list[str]:
    """Problems with the validation batch and packed rows for chosen/rejected pairs
    (``config`` is the RunConfig); the training batch sizes are core's check, with
    :meth:`DPOConfig.batch_size_rules`. A packed row must fit a pair of sequences of the
    longest allowed length."""
    policy = config.policy
    problems = []
    vbs = options.val_global_batch_size
    if vbs is not None and vbs % 2:
        problems.append(
            f"dpo.val_global_batch_size: expected an even number of rows, found {vbs}; use {vbs + 1}."
            f"{where_set(config, 'dpo.val_global_batch_size')}"
        )
    packing = policy.sequence_packing
    if packing.enabled:
        row = packing.max_tokens_per_row or policy.max_total_sequence_length
        longest = config.data.max_length or policy.max_total_sequence_length
        if row < 2 * longest:
            problems.append(
                f"policy.sequence_packing.max_tokens_per_row: a packed row must hold a chosen and a rejected "
                f"sequence of up to {longest} tokens each (data.max_length or policy.max_total_sequence_length), "
                f"so at least {2 * longest} tokens, found {row}; raise it or lower data.max_length to {row // 2}"
                f".{where_set(config, 'policy.sequence_packing.max_tokens_per_row', 'data.max_length')}"
            )
    return problems
