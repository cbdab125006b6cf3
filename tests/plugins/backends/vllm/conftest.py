"""Fixtures of the vLLM backend tests: a tiny model whose head size vLLM's CPU attention
supports (the shared ``tiny`` preset has head_dim 16, which it refuses)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_model_path(tmp_path_factory):
    """The ``tiny`` preset with 2 heads of 32 (hidden 64), seeded like ``tiny_model_path``."""
    from posttrain.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), size="tiny", seed=0, num_heads=2, num_kv_heads=1))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The in-process reference computations use a tiny model: one thread is fastest, and
    more threads thrash on a 2-core machine shared with the Ray engine actors."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
