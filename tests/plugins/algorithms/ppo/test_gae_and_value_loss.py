"""GAE and the critic's loss against float64 references written out per sample and per
token: gaps between turns, samples of different lengths, terminal values, value clipping
(loss and gradient); the estimate and the whitening computed shard by shard (as the critic's
workers do) equal to the whole batch's; and the ``ppo`` section's checks."""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain_ppo.gae import AdvantageEstimate, Whitening, gae, state_values, whitening_stats
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


def rollout_batch(seed: int, n: int = 7, width: int = 10) -> Batch:
    """Critic outputs, rewards and masks of ``n`` samples: actions in one or two runs, one
    sample masked out of the step (``sample_mask`` 0)."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(n, width)
    for i in range(n):
        start = int(torch.randint(1, 4, (), generator=g))
        token_mask[i, start:start + 3] = 1
        if i % 2:
            token_mask[i, start + 5:width] = 1  # a second turn after an observation
    return Batch(
        critic_values=torch.randn(n, width, generator=g),
        shaped_rewards=torch.randn(n, generator=g),
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0] * (n - 2) + [0.0, 1.0]),
    )


def map_in_shards(fn, batch: Batch, shards: list[list[int]]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``fn`` on each shard of rows, as workers run it: the fields put back in row order, the sums added."""
    fields: dict[str, torch.Tensor] = {}
    sums: dict[str, float] = {}
    for rows in shards:
        out, part = fn(batch.select(rows))
        for name, value in out.items():
            fields.setdefault(name, torch.zeros((len(batch), *value.shape[1:]), dtype=value.dtype))[rows] = value
        for name, value in part.items():
            sums[name] = sums.get(name, 0.0) + value
    return fields, sums


@pytest.mark.parametrize("shards", [[list(range(7))], [[0, 1, 2], [3, 4, 5, 6]], [[6, 1], [4], [0, 5, 2, 3]]])
def test_the_estimate_and_its_whitening_by_shards_equal_the_whole_batchs(shards):
    batch = rollout_batch(seed=len(shards))
    values = state_values(batch["critic_values"])
    advantages, returns = gae(values, batch["shaped_rewards"], batch["token_mask"], 0.99, 0.9)
    valid = (batch["token_mask"] * batch["sample_mask"][:, None]) > 0
    mean, std = advantages[valid].double().mean(), advantages[valid].double().std()

    fields, sums = map_in_shards(AdvantageEstimate("critic_values", 0.99, 0.9), batch, shards)
    assert torch.equal(fields["advantages"], advantages) and torch.equal(fields["returns"], returns)
    assert torch.equal(fields["old_values"], values)
    assert sums["tokens"] == float(valid.sum()) < float(batch["token_mask"].sum())  # sample 5 is masked out
    assert sums["returns"] / sums["tokens"] == pytest.approx(float(returns[valid].double().mean()), rel=1e-9)
    assert sums["values"] / sums["tokens"] == pytest.approx(float(values[valid].double().mean()), rel=1e-9)
    assert whitening_stats(sums) == pytest.approx((float(mean), float(std)), rel=1e-9)

    estimated = Batch(**batch.fields(["token_mask", "sample_mask"]), advantages=advantages)
    whitened, nothing = map_in_shards(Whitening(*whitening_stats(sums)), estimated, shards)
    assert nothing == {}
    want = torch.where(valid, (advantages - mean.float()) / (std.float() + 1e-8), 0.0)
    torch.testing.assert_close(whitened["advantages"], want, rtol=1e-6, atol=1e-6)
    assert float(whitened["advantages"][valid].double().mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(whitened["advantages"][valid].double().std()) == pytest.approx(1.0, rel=1e-6)


def test_whitening_stats_with_fewer_than_two_tokens():
    assert whitening_stats({"tokens": 0.0, "advantages": 0.0, "advantages_sq": 0.0}) == (0.0, 0.0)
    assert whitening_stats({"tokens": 1.0, "advantages": 2.5, "advantages_sq": 6.25}) == (2.5, 0.0)


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
