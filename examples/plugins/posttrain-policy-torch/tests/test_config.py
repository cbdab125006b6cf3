"""What one float32 process cannot do is refused when the config is loaded, naming the key."""

from __future__ import annotations

import pytest

from posttrain.config import config_from_dict
from posttrain.errors import ConfigError

POLICY = {"backend": "torch", "model": "unused", "train_global_batch_size": 8, "train_micro_batch_size": 4}


def load(*overrides: str):
    return config_from_dict({"policy": POLICY}, list(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["policy.num_workers=2"],
            "policy.num_workers: the torch backend trains in one process, so it must be 1; found 2. Set "
            "policy.num_workers=1, or use a distributed backend (policy.backend=dtensor). Where set: "
            "policy.num_workers at command line override 'policy.num_workers=2'.",
        ),
        (
            ["policy.num_workers=2", "policy.tensor_parallel_size=2"],
            "policy.tensor_parallel_size: the torch backend trains in one process, so it must be 1; found 2. Set "
            "policy.tensor_parallel_size=1, or use a distributed backend (policy.backend=dtensor). Where set: "
            "policy.tensor_parallel_size at command line override 'policy.tensor_parallel_size=2'.",
        ),
        (
            ["policy.dtype=bfloat16"],
            "policy.dtype: the torch backend supports float32; found 'bfloat16'. Where set: policy.dtype at "
            "command line override 'policy.dtype=bfloat16'.",
        ),
    ],
)
def test_unsupported_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load(*overrides)
    assert str(error.value) == message


def test_another_backends_settings_are_left_alone():
    assert load("policy.backend=dtensor", "policy.num_workers=2").policy.num_workers == 2
