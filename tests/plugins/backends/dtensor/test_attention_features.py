"""Sliding windows and soft-caps on the dtensor backend: Mistral (a window in every layer),
Gemma 2 (windows in alternate layers, attention and final-logit soft-caps) and Gemma 3
(windows in alternate layers), tiny zoo checkpoints whose windows of 8 tokens bind on the
batch's longer samples (up to 24 tokens).

At one rank and with FSDP over two ranks, padded and packed, the policy's logprobs and its
step-0 loss and gradients equal transformers' eager float64 forward of each sample alone
(:func:`posttrain.testing.policy.reference_step`), as do its top-k logits, and the Hugging
Face export of the trained weights reproduces the trainer's loss on them. SGD with lr=1: a step's weight change is the
gradient.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import SequencePackingConfig
from posttrain.testing.policy import reference_logprobs, reference_model
from posttrain_dtensor.policy import DTensorPolicy

pytestmark = pytest.mark.ray

ARCHITECTURES = ("mistral", "gemma2", "gemma3")
WORKERS = {"one_rank": 1, "fsdp_dp2": 2}
PACKING = SequencePackingConfig(enabled=True, max_tokens_per_row=32)


@pytest.fixture(scope="module", params=[(a, layout) for a in ARCHITECTURES for layout in WORKERS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request, zoo_model, virtual_cluster, dt, tmp_path_factory):
    arch, layout = request.param
    path = zoo_model(arch)
    config = dt.policy_config(path, num_workers=WORKERS[layout])
    policy = DTensorPolicy(config, virtual_cluster, name=f"policy-{arch}-{layout}")
    initial_ckpt = str(tmp_path_factory.mktemp(f"{arch}-{layout}") / "step_0")
    policy.save_checkpoint(initial_ckpt)
    batch = dt.make_batch()
    ref_loss, ref_grads = dt.reference_step(path, batch)
    yield dict(policy=policy, path=path, initial_ckpt=initial_ckpt, initial_weights=dt.full_weights(policy),
               batch=batch, ref_loss=ref_loss, ref_grads=ref_grads)
    policy.shutdown()


def _loss(model, batch: Batch) -> float:
    """The batch's token NLL (:class:`TokenNLL`) under ``model``, each sample alone."""
    mask = batch["token_mask"].double() * batch["sample_mask"].double()[:, None]
    with torch.no_grad():
        return float(-(reference_logprobs(model, batch) * mask).sum() / mask.sum())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_logprobs_equal_transformers_eager_forward(policy, setup, dt, packed):
    if packed:
        policy.config.policy.sequence_packing = PACKING
    got = policy.get_logprobs(setup["batch"])["logprobs"]
    want = reference_logprobs(reference_model(setup["path"]), setup["batch"])
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_topk_logits_equal_transformers_topk(policy, setup):
    """Raw top-k logits are the model's own, soft-capped where it caps them (Gemma 2)."""
    batch = setup["batch"]
    got = policy.get_topk_logits(batch, 3)
    model = reference_model(setup["path"])
    for i, n in enumerate(batch["input_lengths"].tolist()):
        with torch.no_grad():
            values, indices = model(batch["input_ids"][i : i + 1, :n]).logits[0].topk(3, dim=-1)
        m = min(n, batch["input_ids"].shape[1] - 1)
        torch.testing.assert_close(got["topk_logits"][i, :m].double(), values[:m], rtol=0, atol=1e-5)
        assert torch.equal(got["topk_indices"][i, :m], indices[:m])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_step_zero_loss_and_gradients_equal_transformers(policy, setup, dt, packed):
    if packed:
        policy.config.policy.sequence_packing = PACKING
    metrics = policy.train(setup["batch"], dt.nll)
    grads = dt.sgd_grads(setup["initial_weights"], dt.full_weights(policy), lr=1.0)
    assert metrics["loss"] == pytest.approx(setup["ref_loss"], abs=1e-5)
    assert dt.max_diff(grads, setup["ref_grads"]) < 1e-5


def test_exported_model_reproduces_the_trainers_loss(policy, setup, dt, tmp_path):
    """After one step: the loss the trainer reports for the batch (eval mode) is the loss of
    the exported folder run by transformers (eager, float64), and differs from step 0's."""
    batch = setup["batch"]
    policy.train(batch, dt.nll)
    trained = policy.train(batch, dt.nll, eval_mode=True)["loss"]
    policy.export_hf(str(tmp_path / "hf"))
    assert _loss(reference_model(tmp_path / "hf"), batch) == pytest.approx(trained, abs=1e-5)
    assert abs(trained - setup["ref_loss"]) > 0.1
