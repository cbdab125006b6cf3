"""GAE and the critic's loss against float64 references written out per sample and per
token: gaps between turns, samples of different lengths, terminal values, value clipping
(loss and gradient), whitening; and the ``ppo`` section's checks."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain_ppo.gae import gae, state_values, whiten
from posttrain_ppo.loss import ValueLoss


def reference_gae(values: list[float], actions: list[int], reward: float, gamma: float, lam: float):
    """One sample, float64, from the definition: actions are the positions listed (in
    order), V_i = values[position], the reward at the last action, terminal value 0."""
    n = len(actions)
    v = [values[p] for p in actions] + [0.0]
    r = [0.0] * (n - 1) + [reward]
    deltas = [r[i] + gamma * v[i + 1] - v[i] for i in range(n)]
    advantages = [sum((gamma * lam) ** k * deltas[i + k] for k in range(n - i)) for i in range(n)]
    return advantages, [a + v[i] for i, a in enumerate(advantages)]


def test_gae_equals_the_definition_in_float64():
    g = torch.Generator().manual_seed(0)
    width = 9
    values = torch.randn(3, width, generator=g, dtype=torch.float64)
    mask = torch.zeros(3, width)
    mask[0, 3:9] = 1  # one turn to the end
    mask[1, [2, 3, 6, 7]] = 1  # two turns with an observation between them
    mask[2, 4:6] = 1  # a short sample, padding after it
    rewards = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (1.0, 0.0)):
        advantages, returns = gae(values, rewards, mask, gamma, lam)
        for i in range(3):
            actions = mask[i].nonzero()[:, 0].tolist()
            want_a, want_r = reference_gae(values[i].tolist(), actions, float(rewards[i]), gamma, lam)
            assert advantages[i, actions].tolist() == pytest.approx(want_a, rel=1e-12, abs=1e-12)
            assert returns[i, actions].tolist() == pytest.approx(want_r, rel=1e-12, abs=1e-12)
            others = [t for t in range(width) if t not in actions]
            assert (advantages[i, others] == 0).all() and (returns[i, others] == 0).all()


def test_with_lambda_1_and_gamma_1_the_returns_are_the_reward():
    values = torch.randn(2, 6, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float64)
    _, returns = gae(values, torch.tensor([3.0, -1.0], dtype=torch.float64), mask, 1.0, 1.0)
    assert returns[0, 1:4].tolist() == pytest.approx([3.0] * 3) and returns[1, 2:].tolist() == pytest.approx([-1.0] * 4)


def test_state_values_are_the_critics_outputs_one_position_earlier():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert state_values(values).tolist() == [[0.0, 1.0, 2.0, 3.0]]


def test_whitening_uses_valid_tokens_only():
    advantages = torch.tensor([[0.0, 1.0, 2.0, 9.0], [3.0, 4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    out = whiten(advantages, mask)
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    want = (valid - valid.mean()) / (valid.std() + 1e-8)
    assert out[mask > 0].tolist() == pytest.approx(want.tolist()) and (out[mask == 0] == 0).all()


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_and_gradient_equal_a_float64_reference(clip):
    g = torch.Generator().manual_seed(1)
    b, width = 4, 8
    outputs = torch.randn(b, width, generator=g, dtype=torch.float64, requires_grad=True)
    token_mask = torch.zeros(b, width)
    token_mask[:, 3:7] = 1
    batch = Batch(token_mask=token_mask, sample_mask=torch.tensor([1.0, 0.0, 1.0, 1.0]),
                  returns=torch.randn(b, width, generator=g, dtype=torch.float64),
                  old_values=torch.randn(b, width, generator=g, dtype=torch.float64) * 0.5)

    total, count = outputs.new_zeros(()), 0
    for i in range(b):
        if batch["sample_mask"][i] == 0:
            continue
        for t in range(width):
            if token_mask[i, t] == 0:
                continue
            v, ret, old = outputs[i, t - 1], batch["returns"][i, t], batch["old_values"][i, t]
            err = (v - ret) ** 2
            if clip is not None:
                err = torch.maximum(err, (old + torch.clamp(v - old, -clip, clip) - ret) ** 2)
            total, count = total + 0.5 * err, count + 1
    expected = total / count
    (grad_expected,) = torch.autograd.grad(expected, outputs)

    loss_fn = ValueLoss(clip)
    toks = torch.tensor(float(count))
    parts = [loss_fn(outputs[r], batch.select(list(range(r.start, r.stop))), torch.tensor(3.0), toks)
             for r in (slice(0, 2), slice(2, 4))]
    loss = parts[0][0] + parts[1][0]
    (grad,) = torch.autograd.grad(loss, outputs)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-10, atol=1e-12)
    fraction = parts[0][1]["value_clip_fraction"] + parts[1][1]["value_clip_fraction"]
    assert (fraction > 0) == (clip is not None)


def test_the_ppo_section_refuses_bad_values_naming_the_key():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"algorithm": "ppo", "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4},
                          "policy": {"train_global_batch_size": 16},
                          "ppo": {"lam": 1.5, "critic": {"train_global_batch_size": 6}}}, source="ppo.yaml")
    assert str(info.value) == (
        "ppo.lam: expected a value in [0, 1], found 1.5. Where set: ppo.lam at ppo.yaml. "
        "ppo.critic.train_global_batch_size: a step's 16 samples (grpo.num_prompts_per_step x "
        "grpo.num_generations_per_prompt) are not a multiple of it (6); choose one that divides 16. Where set: "
        "ppo.critic.train_global_batch_size at ppo.yaml."
    )
