"""The optimizer and clipping settings reach torch: two steps of the worker, run in this
process (outside a worker group it is rank 0 of 1), equal plain ``torch.optim`` on the same
weights. The conformance kit checks the gradient with SGD and no clipping; this checks the
rest of ``policy.optimizer`` and ``policy.max_grad_norm``."""

from __future__ import annotations

import pytest
import torch

from posttrain.backend.work import Batching, plan_pass
from posttrain.config import OptimizerConfig, PolicyConfig, RunConfig
from posttrain.models.tiny import build_tiny_model
from posttrain.testing.generation import NegativeLogLikelihood
from posttrain.testing.policy import contract_batch, max_difference, reference_logprobs, reference_model
from posttrain_policy_torch.worker import TorchPolicyWorker

MAX_GRAD_NORM = 0.5
# eps well above the gradients' float32 noise, so Adam's g / (sqrt(v) + eps) stays smooth
OPTIMIZER = {"lr": 1e-2, "betas": [0.8, 0.9], "eps": 1e-3, "weight_decay": 0.1}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("model"), size="tiny", seed=0))


@pytest.mark.parametrize(("name", "torch_optimizer"), [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_two_clipped_steps_equal_torch_optim(model_path, name, torch_optimizer):
    policy = PolicyConfig(backend="torch", model=model_path, optimizer=OptimizerConfig(name=name, **OPTIMIZER),
                          max_grad_norm=MAX_GRAD_NORM, logprob_chunk_size=16)
    worker = TorchPolicyWorker(RunConfig(policy=policy))
    batches = [contract_batch(seed=1), contract_batch(seed=2)]
    norms = []
    for batch in batches:  # two samples per microbatch: gradient accumulation over two microbatches
        work = plan_pass(batch["input_lengths"].tolist(), 1, Batching(micro_batch_size=2)).work(batch)[0]
        norms.append(worker.train(work, NegativeLogLikelihood())["grad_norm"])

    reference = reference_model(model_path, torch.float32)
    optimizer = torch_optimizer(reference.parameters(), **{**OPTIMIZER, "betas": tuple(OPTIMIZER["betas"])})
    expected_norms = []
    for batch in batches:
        mask = batch["token_mask"] * batch["sample_mask"][:, None]
        loss = -(reference_logprobs(reference, batch) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        expected_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)))
        optimizer.step()

    assert min(expected_norms) > MAX_GRAD_NORM, "the test must exercise clipping"
    assert norms == pytest.approx(expected_norms, rel=1e-4)
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    assert max_difference(expected, worker.gather_weights(list(expected))) < 1e-5
