"""The top-k passes of the dtensor backend for distillation: a teacher's ``topk_logprobs``
are the float64 model's logprobs of its top-k ids at the temperature; one SGD step (lr 1) with
the distillation loss on them (the student's ``topk_logprobs`` input) gives the loss and, for
every weight, the gradient of a float64 Hugging Face model computing the same thing, in
padded and packed rows."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import SequencePackingConfig
from posttrain.testing.policy import reference_model
from posttrain_distill.loss import DistillationLoss
from tests.plugins.algorithms.distill.test_distill_loss import K, reference_kl

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("packing", [False, True])
def test_teacher_logprobs_and_student_gradients_equal_a_float64_model(dt, virtual_cluster, tiny_model_path, packing):
    from posttrain_dtensor.policy import DTensorPolicy

    batch = dt.make_batch()
    temperature = 0.8
    packed = SequencePackingConfig(enabled=packing, max_tokens_per_row=48)
    config = dt.policy_config(tiny_model_path, sequence_packing=packed)
    config.generation.temperature = temperature
    model = reference_model(tiny_model_path)
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    full = (model(input_ids=batch["input_ids"], attention_mask=valid.long()).logits[:, :-1] / temperature).log_softmax(-1)

    teacher = DTensorPolicy(config, virtual_cluster, name="teacher")  # the same model, as a teacher
    try:
        topk = teacher.get_topk_logits(batch, K)
    finally:
        teacher.shutdown()
    real = valid[:, 1:]
    want = full.gather(-1, topk["topk_indices"])
    torch.testing.assert_close(topk["topk_logprobs"][real].double(), want[real].detach(), rtol=0, atol=1e-5)
    # as a teacher at a distinct seed would give: ids and logprobs not those of the student
    g = torch.Generator().manual_seed(4)
    batch["topk_indices"] = torch.randint(0, 103, topk["topk_indices"].shape, generator=g)
    batch["teacher_topk_logprobs"] = (torch.randn((*topk["topk_indices"].shape[:2], 103), generator=g) * 2).log_softmax(
        -1)[..., :K]
    loss_fn = DistillationLoss("mixed", forward_weight=0.4)

    policy = DTensorPolicy(config, virtual_cluster)
    try:
        before = dt.full_weights(policy)
        metrics = policy.train(batch, loss_fn)
        grads = dt.sgd_grads(before, dt.full_weights(policy), lr=1.0)
    finally:
        policy.shutdown()

    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    student = torch.nn.functional.pad(full.gather(-1, batch["topk_indices"]), (0, 0, 1, 0))
    aligned = torch.nn.functional.pad(batch["teacher_topk_logprobs"], (0, 0, 1, 0))
    loss = (reference_kl(student, aligned, "mixed", 0.4) * mask).sum() / mask.sum()
    loss.backward()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    expected = dict(model.named_parameters())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)
