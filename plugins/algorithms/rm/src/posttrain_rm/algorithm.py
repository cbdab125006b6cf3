"""The ``rm`` algorithm: core's supervised loop over preference pairs, on a value head, with
the Bradley-Terry loss."""

from __future__ import annotations

import attrs

from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.run.supervised import SupervisedAlgorithm


class RewardModel(SupervisedAlgorithm):
    """Bradley-Terry reward-model training with core's supervised loop (:mod:`posttrain.run.supervised`).

    Reads ``preference`` data: each example gives two rows, chosen (even) then rejected
    (odd), so ``policy.train_global_batch_size`` counts rows, twice the pairs. The model is
    ``policy.model`` with a value head (``policy.head: value``: a new one-output ``score``
    layer when the folder holds a causal LM); validation reports the held-out ``accuracy``
    and ``margin``; ``rm.export_dir`` receives a sequence-classification folder
    (``AutoModelForSequenceClassification``) that the ``reward_model`` environment loads.
    """

    name = "rm"
    config_section = "rm"
    data_kind = "preference"
    rows_per_example = 2

    def policy_config(self, config: RunConfig) -> PolicyConfig:
        return attrs.evolve(config.policy, head="value")
