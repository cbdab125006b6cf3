"""The ``rm`` config section and the ``reward_model`` environment's options. Imports only
attrs and core's config helpers: the plugin module declaring them stays light."""

from __future__ import annotations

import attrs

from posttrain.config.environments import above
from posttrain.config.validate import BatchSizeRules
from posttrain.run.supervised_config import SupervisedConfig, check_supervised_config


@attrs.define
class RMConfig(SupervisedConfig):
    """Options of the ``rm`` algorithm: the supervised loop's
    (:class:`~posttrain.run.supervised_config.SupervisedConfig`) and its loss's (see
    :class:`posttrain_rm.loss.BradleyTerryLoss`). The policy is built with a value head
    (``policy.head: value``) on ``policy.model``; ``rm.export_dir`` receives a Hugging Face
    sequence-classification folder."""

    loss: str = "bradley_terry"  # a name in the loss registry
    # adds coefficient * (r_chosen + r_rejected)^2 per pair, which keeps scores centred on 0 (as TRL's
    # center_rewards_coefficient); None: off
    center_rewards_coefficient: float | None = None

    def batch_size_rules(self) -> BatchSizeRules:
        """Batch sizes count rows, a chosen and a rejected row per pair: core keeps whole
        pairs in every microbatch (and so on every data-parallel rank)."""
        return BatchSizeRules(micro_multiple=2, micro_reason="whole chosen/rejected pairs of rows")


def check_options(options: RMConfig) -> list[str]:
    """Problems with the ``rm`` section, each naming its key, what was expected and what was found."""
    problems = check_supervised_config("rm", options)
    coefficient = options.center_rewards_coefficient
    if coefficient is not None and coefficient < 0:
        problems.append(f"rm.center_rewards_coefficient: expected 0 or more, or null, found {coefficient}")
    vbs = options.val_global_batch_size
    if vbs is not None and vbs % 2:
        problems.append(f"rm.val_global_batch_size: expected an even number of rows (chosen and rejected), found {vbs}")
    return problems


@attrs.frozen
class RewardModelOptions:
    """Options of the ``reward_model`` environment (``environments.reward_model``)."""

    model: str = attrs.field(kw_only=True)  # a Hugging Face sequence-classification folder (e.g. rm.export_dir)
    tokenizer: str | None = None  # the tokenizer folder; None: the model's
    # a Jinja template file, or the template text, rendering conversations as the reward model was trained
    # (data.chat_template of its run); None: the tokenizer's
    chat_template: str | None = None
    batch_size: int = attrs.field(default=32, validator=above(0))  # conversations scored per forward pass
