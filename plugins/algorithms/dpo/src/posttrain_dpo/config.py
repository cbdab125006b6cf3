"""The ``dpo`` config section: the SFT loop options plus the DPO loss options."""

from __future__ import annotations

import attrs
from posttrain_sft.config import SFTConfig, check_loop_options

LOSS_TYPES = ("sigmoid", "ipo")


@attrs.define
class DPOConfig(SFTConfig):
    """Options of the ``dpo`` algorithm and its loss (see :class:`posttrain_dpo.loss.DPOLoss`)."""

    beta: float = 0.1  # strength of the pull towards the reference policy
    loss_type: str = "sigmoid"  # sigmoid | ipo
    reference_free: bool = False  # compare chosen and rejected without a reference policy
    average_log_probs: bool = False  # length-normalise sequence logprobs (usual with ipo)
    sft_weight: float = 0.0  # weight of the NLL of the chosen responses added to the loss
    label_smoothing: float = 0.0  # sigmoid only: assumed probability that a label is flipped
    loss: str = "dpo"


def check_options(options: DPOConfig) -> list[str]:
    """Problems with the ``dpo`` section, each naming its key, what was expected and what was found."""
    problems = check_loop_options("dpo", options)
    if options.loss_type not in LOSS_TYPES:
        problems.append(f"dpo.loss_type: expected one of {', '.join(LOSS_TYPES)}, found '{options.loss_type}'")
    if not options.beta > 0:
        problems.append(f"dpo.beta: expected a positive number, found {options.beta}")
    if options.sft_weight < 0:
        problems.append(f"dpo.sft_weight: expected 0 or more, found {options.sft_weight}")
    if not 0 <= options.label_smoothing < 0.5:
        problems.append(f"dpo.label_smoothing: expected a value in [0, 0.5), found {options.label_smoothing}")
    elif options.label_smoothing and options.loss_type != "sigmoid":
        problems.append(f"dpo.label_smoothing: applies to loss_type sigmoid only, found loss_type '{options.loss_type}'")
    return problems
