"""Fixtures of the vLLM backend tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_model_path(tiny_model_path):
    """The shared tiny model (its head size, 32, is one vLLM's CPU attention accepts)."""
    return tiny_model_path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The in-process reference computations use a tiny model: one thread is fastest, and
    more threads thrash on a 2-core machine shared with the Ray engine actors."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
