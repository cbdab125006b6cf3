"""The plugin author's kit: contract tests to subclass and pytest fixtures.

See :mod:`posttrain.testing.contracts` for :class:`EnvironmentContract`,
:class:`LossContract` and :class:`DataPlaneContract`, and
:mod:`posttrain.testing.pytest_plugin` for the fixtures.
"""

from posttrain.testing.contracts import DataPlaneContract, EnvironmentCase, EnvironmentContract, LossContract

__all__ = ["DataPlaneContract", "EnvironmentCase", "EnvironmentContract", "LossContract"]
