"""The policy and generation sections GRPO starts its worker groups with."""

from __future__ import annotations

import os

import attrs

from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig
from posttrain_grpo.config import GRPOConfig

#: The OpenMP variable that says whether idle threads spin (ACTIVE) or sleep (PASSIVE).
WAIT_POLICY = "OMP_WAIT_POLICY"


def worker_sections(config: RunConfig, grpo: GRPOConfig) -> tuple[PolicyConfig, GenerationConfig]:
    """The run's ``policy`` and ``generation`` sections, except that asynchronous GRPO on CPUs
    (``grpo.asynchronous.max_staleness_steps`` >= 1, ``cluster.use_gpus`` false) gives the
    policy's workers and the engines ``OMP_WAIT_POLICY=PASSIVE`` unless their
    ``resources.env_vars`` (or ``runtime_env``'s) or the driver's environment set it.

    The policy then trains while the engines generate, on the same cores. OpenMP threads spin
    while they wait for work by default, so each process's idle threads take cores from the
    other's busy ones; passive threads sleep. On the 2-core benchmark machine an asynchronous
    step took 33 s spinning and 21 s passive, against 26 s synchronous (docs/benchmarks.md).
    A synchronous run keeps the default: its policy and engines take turns, and passive
    waiting made its generation about 12% slower there."""
    if not grpo.asynchronous.enabled or config.cluster.use_gpus or WAIT_POLICY in os.environ:
        return config.policy, config.generation
    policy, generation = config.policy, config.generation
    return (
        attrs.evolve(policy, resources=policy.resources.with_env_default(WAIT_POLICY, "PASSIVE")),
        attrs.evolve(generation, resources=generation.resources.with_env_default(WAIT_POLICY, "PASSIVE")),
    )


def with_rows_per_call(generation: GenerationConfig, grpo: GRPOConfig, validation_prompts: int) -> GenerationConfig:
    """``generation`` with ``rows_per_call`` filled where it is null: the most rows one generate
    call of the run brings, the larger of a step's samples (``grpo.samples_per_step``; a turn
    of a multi-turn round brings no more) and the validation prompts (one greedy row each)."""
    return generation.with_rows_per_call(max(grpo.samples_per_step, validation_prompts))
