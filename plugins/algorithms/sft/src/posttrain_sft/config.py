"""The ``sft`` config section."""

from __future__ import annotations

import attrs

from posttrain.run.supervised_config import SupervisedConfig


@attrs.define
class SFTConfig(SupervisedConfig):
    """Options of the ``sft`` algorithm: the supervised loop's (steps, epochs, validation,
    export; :class:`~posttrain.run.supervised_config.SupervisedConfig`) and its loss."""

    loss: str = "nll"  # a name in the loss registry
