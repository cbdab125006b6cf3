"""The ``sft`` algorithm: next-token NLL on the assistant tokens of a conversation dataset."""

from __future__ import annotations

from posttrain.run.supervised import SupervisedAlgorithm


class SFT(SupervisedAlgorithm):
    """Supervised fine-tuning with core's supervised loop (:mod:`posttrain.run.supervised`).

    Reads ``sft`` data (conversations or prompt/response rows; only assistant tokens carry
    loss) and trains with the loss named by ``sft.loss`` (default ``nll``).
    """

    name = "sft"
    config_section = "sft"
    data_kind = "sft"
    rows_per_example = 1
