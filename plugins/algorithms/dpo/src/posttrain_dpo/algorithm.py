"""The ``dpo`` algorithm: core's supervised loop over preference pairs with the DPO loss."""

from __future__ import annotations

import attrs

from posttrain.interfaces.data_plane import PlaneSamples
from posttrain.interfaces.policy import Policy
from posttrain.run.supervised import SupervisedAlgorithm
from posttrain_dpo.config import DPOConfig


class DPO(SupervisedAlgorithm):
    """Direct preference optimisation with core's supervised loop (:mod:`posttrain.run.supervised`).

    Reads ``preference`` data: each example gives two rows, chosen (even) then rejected
    (odd), so ``policy.train_global_batch_size`` counts rows, twice the pairs. Before each
    training or validation pass the frozen initial weights score the batch once, written into
    its data-plane partition as ``reference_logprobs`` (``policy.logprobs_into(...,
    reference=True)``), unless ``dpo.reference_free`` or ``dpo.loss_type`` is ``sft``.
    """

    name = "dpo"
    config_section = "dpo"
    data_kind = "preference"
    rows_per_example = 2

    def uses_reference(self, options: DPOConfig) -> bool:
        return not options.reference_free and options.loss_type != "sft"

    def prepare_batch(self, policy: Policy, samples: PlaneSamples, options: DPOConfig) -> PlaneSamples:
        if not self.uses_reference(options):
            return samples
        policy.logprobs_into(samples, "reference_logprobs", reference=True)
        return attrs.evolve(samples, fields=(*samples.fields, "reference_logprobs"))
