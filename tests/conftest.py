"""Shared fixtures: offline environment, a tiny local model, and one Ray cluster per session."""

from __future__ import annotations

import os

# Set before anything imports transformers, ray or vllm.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A seeded tiny Llama + character tokenizer saved as a Hugging Face folder."""
    from posttrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0))


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory):
    """``zoo_model(name)``: the folder of the seeded tiny checkpoint of
    :mod:`posttrain.testing.zoo` architecture ``name``, built once per session."""
    from posttrain.testing.zoo import build_zoo_model

    built: dict[str, str] = {}

    def path(name: str) -> str:
        if name not in built:
            built[name] = str(build_zoo_model(tmp_path_factory.mktemp(f"zoo_{name}"), name))
        return built[name]

    return path


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (4 logical CPUs on any machine)."""
    import ray

    if not ray.is_initialized():
        # address="local": a cluster of its own, never one a developer started with `ray start`
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()
