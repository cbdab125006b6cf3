"""The torch backend against posttrain's policy conformance kit.

``ray_local`` is the kit's session fixture: it joins the Ray cluster this pytest process is
already connected to (the repository suite's, when run as part of it) or starts one.
"""

from __future__ import annotations

import pytest

from posttrain.testing import PolicyContract

pytest_plugins = ["posttrain.testing.pytest_plugin"]


@pytest.mark.ray
class TestTorchPolicyContract(PolicyContract):
    name = "torch"
