"""The plugin author's kit: contract tests to subclass and pytest fixtures.

See :mod:`posttrain.testing.contracts` for :class:`EnvironmentContract` and
:class:`LossContract`, and :mod:`posttrain.testing.pytest_plugin` for the fixtures.
"""

from posttrain.testing.contracts import EnvironmentCase, EnvironmentContract, LossContract

__all__ = ["EnvironmentCase", "EnvironmentContract", "LossContract"]
