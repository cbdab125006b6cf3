"""The ``dpo`` algorithm: the supervised loop over preference pairs with the DPO loss."""

from __future__ import annotations

from posttrain.batch import Batch
from posttrain.interfaces.policy import Policy
from posttrain_dpo.config import DPOConfig
from posttrain_sft.loop import SupervisedAlgorithm


class DPO(SupervisedAlgorithm):
    """Direct preference optimisation with the supervised loop (:mod:`posttrain_sft.loop`).

    Reads ``preference`` data: each example gives two rows, chosen (even) then rejected
    (odd), so ``policy.train_global_batch_size`` counts rows, twice the pairs. Before each
    training or validation pass the frozen initial weights score the batch once
    (``policy.get_reference_policy_logprobs``), unless ``dpo.reference_free``.
    """

    name = "dpo"
    config_section = "dpo"
    data_kind = "preference"
    rows_per_example = 2

    def prepare_batch(self, policy: Policy, batch: Batch, options: DPOConfig) -> Batch:
        if not options.reference_free:
            batch["reference_logprobs"] = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
        return batch
