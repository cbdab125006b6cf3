"""Sliding-window models on one megatron rank (local layers) against transformers' eager
float64 forward: Mistral (a window in every layer) and Qwen2 with windows in its second layer
only, tiny zoo checkpoints whose 8-token windows bind on the batch's longer samples (up to
24 tokens). SGD with lr=1: a step's weight change is the gradient."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.testing.generation import NegativeLogLikelihood  # noqa: E402
from posttrain.testing.zoo import WINDOW, build_zoo_model  # noqa: E402
from posttrain_megatron.policy import MegatronPolicy  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.ray]

#: name: (zoo architecture, overrides)
MODELS = {
    "mistral": ("mistral", {}),
    "qwen2_windowed": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, virtual_cluster, mg, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    path = str(build_zoo_model(tmp_path_factory.mktemp(request.param), arch, **overrides))
    policy = MegatronPolicy(mg.policy_config(path), virtual_cluster, name=f"megatron-{request.param}")
    yield dict(policy=policy, path=path, batch=mg.make_batch())
    policy.shutdown()


def test_logprobs_loss_and_gradients_equal_transformers(setup, mg):
    policy, batch = setup["policy"], setup["batch"]
    got = policy.get_logprobs(batch)["logprobs"]
    torch.testing.assert_close(got.double(), mg.reference_logprobs(setup["path"], batch), rtol=0, atol=1e-5)
    before = mg.full_weights(policy)
    metrics = policy.train(batch, NegativeLogLikelihood())
    after = mg.full_weights(policy)
    ref_loss, ref_grads = mg.reference_nll_step(setup["path"], batch)
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert max(float(((before[k].double() - after[k].double()) - ref_grads[k]).abs().max()) for k in before) < 1e-5
