"""The in-memory data plane, through the registry like any plugin's."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import RunConfig
from posttrain.plugins import new_plugin_host
from posttrain.testing import DataPlaneContract

pytest_plugins = ["posttrain.testing.pytest_plugin"]


@pytest.fixture
def plane():
    return new_plugin_host().data_planes["memory"](RunConfig())


def test_put_get_in_key_order_with_padding(plane):
    plane.put("train/1", ["a", "b"], {"ids": torch.tensor([[1, 2, 3], [4, 5, 6]]), "log": [["m1"], ["m2"]]})
    plane.put("train/1", ["c"], {"ids": torch.tensor([[7, 8, 9]]), "log": [["m3"]]})
    out = plane.get("train/1", ["c", "a"], ["ids", "log"])
    assert out["ids"].tolist() == [[7, 8, 9], [1, 2, 3]]
    assert out["log"] == [["m3"], ["m1"]]
    assert plane.keys("train/1") == ["a", "b", "c"]


def test_fields_added_later_and_replaced(plane):
    plane.put("p", ["a", "b"], {"x": torch.tensor([1.0, 2.0])})
    plane.put("p", ["b", "a"], {"logprobs": torch.tensor([[0.5], [0.25]])})
    plane.put("p", ["a"], {"x": torch.tensor([9.0])})
    out = plane.get("p", ["a", "b"], ["x", "logprobs"])
    assert out["x"].tolist() == [9.0, 2.0]
    assert out["logprobs"].tolist() == [[0.25], [0.5]]


def test_tags_without_fields(plane):
    plane.put("p", ["a", "b", "c"], {"x": torch.zeros(3, 4)}, tags={"keep": torch.tensor([True, False, True]), "length": torch.tensor([3, 1, 2])})
    tags = plane.tags("p")
    assert tags["keep"].tolist() == [True, False, True]
    assert plane.tags("p", ["c"])["length"].tolist() == [2]


def test_clear_and_errors(plane):
    plane.put("p", ["a"], {"x": torch.zeros(1)})
    with pytest.raises(KeyError, match="has no field\\(s\\) \\['y'\\]"):
        plane.get("p", ["a"], ["y"])
    with pytest.raises(KeyError, match="has no sample 'z'"):
        plane.get("p", ["z"], ["x"])
    plane.clear("p")
    plane.clear("p")  # clearing twice is fine
    assert plane.partitions() == []
    with pytest.raises(KeyError, match="data plane has no partition 'p'"):
        plane.keys("p")
    with pytest.raises(ValueError, match="field 'x' has 2 rows for 1 keys"):
        plane.put("q", ["a"], {"x": torch.zeros(2)})


class TestMemoryPlaneContract(DataPlaneContract):
    """The shared data-plane contract holds for the reference itself."""

    name = "memory"
