"""Generalised advantage estimation over the generated tokens of rollouts.

A sample's actions are its generated tokens (``token_mask`` 1), in order; other positions
(the prompt, environment observations between turns, padding) are not actions and are
skipped. The value of the state before action ``i`` (at position ``t_i``) is the critic's
output at position ``t_i - 1``, having read every token before it (``values`` here holds it at
``t_i``, see :func:`state_values`). The reward is the sample's reward at its last action, 0 at
the others; the state after the last action is terminal (value 0). Then

    delta_i = r_i + gamma * V_{i+1} - V_i,    A_i = sum_l (gamma * lambda)^l * delta_{i+l},
    returns_i = A_i + V_i,

written at each action's position; 0 elsewhere.

In a run the estimate is computed next to the data (the critic's workers, through
:meth:`~posttrain.interfaces.Policy.map_into`), sample by sample: :class:`AdvantageEstimate`
writes each sample's advantages and returns and sums what the step's whitening needs;
:func:`whitening_stats` forms the mean and standard deviation over the step's valid tokens
from those sums, and :class:`Whitening` applies them, again sample by sample. The driver
holds only the sums.
"""

from __future__ import annotations

import math

import attrs
import torch

from posttrain.batch import Batch


def state_values(values: torch.Tensor) -> torch.Tensor:
    """The critic's value of the state before each token: ``values[:, t - 1]`` at position ``t``
    (0 at ``t = 0``), from its outputs ``values`` [B, S] at every position."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


def gae(
    values: torch.Tensor, rewards: torch.Tensor, actions: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, S] (module docstring): ``values`` [B, S] the state values
    aligned with each position (:func:`state_values`), ``rewards`` [B] each sample's reward,
    ``actions`` [B, S] the generated tokens (``token_mask``). Computed in the dtype of ``values``."""
    acting = actions > 0
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    after_last = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)  # seen the last action
    for t in reversed(range(values.shape[1])):
        act = acting[:, t]
        reward = torch.where(act & ~after_last, rewards.to(values.dtype), 0.0)
        delta = reward + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(act, advantage, 0.0)
        next_value = torch.where(act, values[:, t], next_value)
        next_advantage = torch.where(act, advantage, next_advantage)
        after_last |= act
    returns = torch.where(acting, advantages + values, 0.0)
    return advantages, returns


def valid_tokens(batch: Batch) -> torch.Tensor:
    """1 at the generated tokens (``token_mask``) of samples the step trains on (``sample_mask``), else 0."""
    return batch["token_mask"] * batch["sample_mask"][:, None]


@attrs.frozen
class AdvantageEstimate:
    """A :class:`~posttrain.interfaces.SampleMap`: :func:`gae` of each sample from the critic's
    outputs ``values_field``, ``shaped_rewards`` and ``token_mask``. Writes ``advantages``,
    ``returns`` and ``old_values`` (the state values, :func:`state_values`); sums over the
    :func:`valid_tokens`, in float64: ``tokens``, and the ``advantages``, their squares
    (``advantages_sq``), ``returns`` and ``values``."""

    values_field: str
    gamma: float
    lam: float

    def __call__(self, batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        values = state_values(batch[self.values_field])
        advantages, returns = gae(values, batch["shaped_rewards"], batch["token_mask"], self.gamma, self.lam)
        valid = valid_tokens(batch).double()
        totals = {
            "tokens": valid,
            "advantages": advantages.double() * valid,
            "advantages_sq": advantages.double().square() * valid,
            "returns": returns.double() * valid,
            "values": values.double() * valid,
        }
        sums = {name: float(total.sum()) for name, total in totals.items()}
        return {"advantages": advantages, "returns": returns, "old_values": values}, sums


def whitening_stats(sums: dict[str, float]) -> tuple[float, float]:
    """``(mean, std)`` of the advantages over the valid tokens, from the added sums of
    :class:`AdvantageEstimate`; std with Bessel's correction, 0 with fewer than 2 tokens."""
    n = sums["tokens"]
    if n == 0:
        return 0.0, 0.0
    mean = sums["advantages"] / n
    variance = max(sums["advantages_sq"] - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(variance)


@attrs.frozen
class Whitening:
    """A :class:`~posttrain.interfaces.SampleMap`: ``advantages`` become ``(A - mean) / (std +
    1e-8)`` at the :func:`valid_tokens`, 0 elsewhere."""

    mean: float
    std: float

    def __call__(self, batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        valid = valid_tokens(batch) > 0
        advantages = batch["advantages"]
        return {"advantages": torch.where(valid, (advantages - self.mean) / (self.std + 1e-8), 0.0)}, {}
