"""The distillation loss: value and gradient equal an independent float64 computation for
each KL (reverse, forward, mixed), split over microbatches (through a policy backend:
tests/plugins/backends/dtensor/test_topk_logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain_distill.loss import DistillationLoss

K = 4


def reference_kl(student: torch.Tensor, teacher: torch.Tensor, kind: str, weight: float) -> torch.Tensor:
    """Per-position KL [b, S] written out term by term in float64 over the k tokens and "any
    other token": ``student`` and ``teacher`` [b, S, k] logprobs, aligned to the same positions."""
    p, q = torch.exp(student.double()), torch.exp(teacher.double())
    p_rest = torch.clamp(1 - p.sum(-1), min=1e-6)
    q_rest = torch.clamp(1 - q.sum(-1), min=1e-6)
    reverse = (p * (torch.log(p) - torch.log(q))).sum(-1) + p_rest * (torch.log(p_rest) - torch.log(q_rest))
    forward = (q * (torch.log(q) - torch.log(p))).sum(-1) + q_rest * (torch.log(q_rest) - torch.log(p_rest))
    return {"reverse": reverse, "forward": forward, "mixed": weight * forward + (1 - weight) * reverse}[kind]


def random_case(seed: int = 0):
    """Student logprobs [b, S, k] and a teacher's [b, S-1, k], each the first k of a softmax over 30 tokens."""
    g = torch.Generator().manual_seed(seed)
    b, width = 4, 7
    lengths = torch.tensor([7, 5, 3, 6])
    token_mask = ((torch.arange(width)[None, :] >= 2) & (torch.arange(width)[None, :] < lengths[:, None])).float()
    student = (torch.randn(b, width, 30, generator=g, dtype=torch.float64) * 2).log_softmax(-1)[..., :K].clone()
    teacher = (torch.randn(b, width - 1, 30, generator=g, dtype=torch.float64) * 3).log_softmax(-1)[..., :K]
    batch = Batch(input_lengths=lengths, token_mask=token_mask, sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
                  teacher_topk_logprobs=teacher)
    return student, batch


@pytest.mark.parametrize("kind", ["reverse", "forward", "mixed"])
def test_loss_and_gradient_equal_a_float64_reference(kind):
    student, batch = random_case()
    student.requires_grad_()
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    aligned = torch.nn.functional.pad(batch["teacher_topk_logprobs"], (0, 0, 1, 0))
    expected = (reference_kl(student, aligned, kind, 0.3) * mask).sum() / mask.sum()
    (grad_expected,) = torch.autograd.grad(expected, student)

    loss_fn = DistillationLoss(kind, forward_weight=0.3)
    toks = mask.sum()
    parts = [loss_fn(student[rows], batch.select(list(range(rows.start, rows.stop))), batch["sample_mask"].sum(), toks)
             for rows in (slice(0, 2), slice(2, 4))]
    loss = parts[0][0] + parts[1][0]
    (grad,) = torch.autograd.grad(loss, student)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-10, atol=1e-12)
    assert grad[~mask.bool()].abs().max() == 0  # prompt, padding and dropped samples carry nothing
    name = {"reverse": "reverse_kl", "forward": "forward_kl"}.get(kind)
    if name:
        assert parts[0][1][name] + parts[1][1][name] == pytest.approx(expected.item(), rel=1e-9)
    assert 0 < parts[0][1]["topk_mass"] + parts[1][1]["topk_mass"] < 1


def test_identical_distributions_give_zero_and_mass_outside_the_top_k_costs():
    student, batch = random_case(seed=2)
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    batch["teacher_topk_logprobs"] = student[:, 1:].clone()  # the teacher agrees with the student
    for kind in ("reverse", "forward", "mixed"):
        loss, _ = DistillationLoss(kind)(student, batch, batch["sample_mask"].sum(), mask.sum())
        assert abs(loss.item()) < 1e-12, kind
    # the same shape on the k tokens, but the student puts half its mass elsewhere
    batch["teacher_topk_logprobs"] = (student[:, 1:] - torch.logsumexp(student[:, 1:], -1, keepdim=True)).clone()
    loss, metrics = DistillationLoss("reverse")(student, batch, batch["sample_mask"].sum(), mask.sum())
    assert loss.item() > 0.1 and metrics["teacher_topk_mass"] == pytest.approx(1.0)
