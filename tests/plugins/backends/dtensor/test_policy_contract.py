"""The dtensor backend passes the policy contract: one rank (the plain module) and two
data-parallel ranks (FSDP2, gradients reduced across ranks)."""

from __future__ import annotations

import pytest

from posttrain.testing import PolicyContract

pytestmark = pytest.mark.ray


@pytest.fixture(scope="session")
def ray_local(ray_cluster):
    return ray_cluster


class TestDTensorPolicyContract(PolicyContract):
    name = "dtensor"


class TestDTensorDataParallelPolicyContract(PolicyContract):
    name = "dtensor"
    policy_overrides = {"num_workers": 2}
