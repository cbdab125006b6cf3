"""The megatron backend passes the policy contract (one rank on CPU, megatron-core's own
optimizer and checkpoints)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.testing import PolicyContract  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.megatron]


@pytest.fixture(scope="session")
def ray_local(ray_cluster):
    return ray_cluster


class TestMegatronPolicyContract(PolicyContract):
    name = "megatron"
