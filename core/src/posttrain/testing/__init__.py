"""The plugin author's kit: contract tests to subclass and pytest fixtures.

- :class:`EnvironmentContract`, :class:`LossContract`, :class:`DataPlaneContract`
  (:mod:`posttrain.testing.contracts`) and :class:`PolicyContract`
  (:mod:`posttrain.testing.policy`): pytest classes; a ``Test...`` subclass names the plugin.
- :class:`GenerationContract` (:mod:`posttrain.testing.generation`): checks a running
  generation backend against transformers on the same weights.
- Fixtures (``posttrain_host``, ``ray_local``): :mod:`posttrain.testing.pytest_plugin`.
"""

from posttrain.testing.contracts import DataPlaneContract, EnvironmentCase, EnvironmentContract, LossContract
from posttrain.testing.generation import GenerationContract
from posttrain.testing.policy import PolicyContract

__all__ = [
    "DataPlaneContract",
    "EnvironmentCase",
    "EnvironmentContract",
    "GenerationContract",
    "LossContract",
    "PolicyContract",
]
