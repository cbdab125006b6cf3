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
"""

from __future__ import annotations

import torch


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


def whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean) / (std + 1e-8)`` over the positions where ``mask`` > 0 (0 elsewhere); std
    with Bessel's correction, 0 when fewer than 2 positions."""
    valid = mask > 0
    count = valid.sum()
    mean = advantages[valid].mean()
    std = advantages[valid].std() if count > 1 else advantages.new_zeros(())
    return torch.where(valid, (advantages - mean) / (std + 1e-8), 0.0)
