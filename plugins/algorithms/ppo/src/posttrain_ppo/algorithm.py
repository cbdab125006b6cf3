"""The ``ppo`` algorithm (``posttrain run ppo``): PPO with a value model, on GRPO's loop.

A step is GRPO's (:mod:`posttrain_grpo.algorithm`: rounds of rollouts, staleness, dynamic
sampling, the clipped policy loss with ``grpo.loss``, refit, validation), with the critic
added::

    ... step s: after the policy's logprob passes
      -> critic (its own worker group, a value head): values of the step's samples, written
         into the partition (by the critic's workers, where they reach the data plane)
      -> GAE (ppo.gamma, ppo.lam) over the generated tokens, the reward (grpo's scaled and
         shaped reward) at each sample's last token -> per-token advantages (whitened with
         ppo.normalize_advantages) and returns -> the data plane, in place of GRPO's group
         advantages; computed by the critic's workers where they reach the plane
         (:mod:`posttrain_ppo.gae`), the driver holding only sums
      -> policy.train(clipped_pg) on those advantages (GRPO's loss, unchanged)
      -> critic.train(value loss with ppo.value_clip) on the returns, one optimizer step per
         ppo.critic.train_global_batch_size samples
      -> refit (the policy only) ...

Checkpoints hold the critic beside the policy (``critic/``); a resumed run restores both.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import attrs

from posttrain.errors import CheckpointError
from posttrain.interfaces import PlaneSamples, Policy
from posttrain.run.checkpoint import TrainingState
from posttrain.run.context import RunContext
from posttrain.run.metrics import combine_train_passes
from posttrain.run.startup import Started, Startup
from posttrain_grpo.algorithm import GRPO, GRPORun
from posttrain_grpo.step import LOGPROB_FIELDS
from posttrain_ppo.config import PPOConfig
from posttrain_ppo.gae import AdvantageEstimate, Whitening, whitening_stats
from posttrain_ppo.loss import ValueLoss

#: Where a checkpoint keeps the critic.
CRITIC_DIR = "critic"
#: The partition field the critic's value pass writes (its output at every position).
CRITIC_OUTPUT = "critic_values"
#: What the critic's training pass reads.
CRITIC_FIELDS = (*LOGPROB_FIELDS, "returns", "old_values")


class PPO(GRPO):
    """Proximal policy optimisation with a critic (options: the ``ppo`` section, and the
    ``grpo`` section for everything the two share)."""

    name = "ppo"
    config_section = "ppo"

    def steps(self, context: RunContext) -> PPORun:
        return PPORun(context, self.environment_plugins)


@attrs.frozen
class PPOState(TrainingState):
    """GRPO's training state and the critic's checkpoint (``critic/``)."""

    critic: Policy

    def save(self, folder: Path) -> None:
        super().save(folder)
        self.critic.save_checkpoint(str(folder / CRITIC_DIR))

    def load(self, folder: Path, algorithm: str) -> None:
        if not (folder / CRITIC_DIR).exists():
            raise CheckpointError(
                f"checkpoint {folder} has no {CRITIC_DIR}; it was not written by a {algorithm} run. Point "
                f"checkpointing.dir at a {algorithm} run's checkpoints, or set checkpointing.resume=false"
            )
        super().load(folder, algorithm)
        self.critic.load_checkpoint(str(folder / CRITIC_DIR))


class PPORun(GRPORun):
    """GRPO's steps with a critic: values, GAE advantages and returns before the policy
    trains, the critic's training after."""

    label = "PPO"

    def __init__(self, ctx: RunContext, environment_plugins: Any):
        super().__init__(ctx, environment_plugins)
        self.ppo: PPOConfig = self.config.section("ppo")
        self.value_loss = ValueLoss(self.ppo.value_clip)
        critic_steps = max(1, self.grpo.samples_per_step // self.ppo.critic.train_global_batch_size)
        self.critic_schedule_steps = self.plan.total_steps * critic_steps
        self.advantage_metrics: dict[str, float] = {}
        self._critic: Started[Policy] | None = None

    def start_more(self, startup: Startup) -> None:
        """The critic, started with GRPO's parts: ``ppo.critic`` with a value head, on
        ``policy.model`` unless it names a model of its own."""
        section = self.ppo.critic
        critic = attrs.evolve(section, head="value", model=section.model or self.config.policy.model)
        self._critic = startup.start("critic", lambda: self.ctx.build_policy(
            schedule_steps=self.critic_schedule_steps, policy=critic, name="critic", reference=False
        ))

    def start_services(self, cleanup: contextlib.ExitStack) -> None:
        super().start_services(cleanup)
        assert self._critic is not None, "start_services() starts the critic through start_more()"
        self.critic = self._critic.value

    def training_state(self) -> TrainingState:
        return PPOState(self.policy, self.prompts, self.critic)

    def add_logprobs(self, partition: str, keys: list[str]) -> None:
        """GRPO's logprob passes, then the critic's values and the GAE advantages and returns,
        written into the partition (the advantages replace GRPO's). The critic's workers read
        the samples from the plane and write the results themselves where they can reach it;
        the driver receives the sums that the metrics and the whitening need."""
        super().add_logprobs(partition, keys)
        self.critic.values_into(PlaneSamples(self.plane, partition, keys, LOGPROB_FIELDS), CRITIC_OUTPUT)
        ppo = self.ppo
        masks = ["token_mask", "sample_mask"]
        sums = self.critic.map_into(
            PlaneSamples(self.plane, partition, keys, [CRITIC_OUTPUT, "shaped_rewards", *masks]),
            AdvantageEstimate(CRITIC_OUTPUT, ppo.gamma, ppo.lam),
        )
        tokens = max(sums["tokens"], 1.0)
        self.advantage_metrics = {f"ppo/{name}_mean": sums[name] / tokens for name in ("advantages", "returns", "values")}
        if ppo.normalize_advantages:
            mean, std = whitening_stats(sums)
            self.critic.map_into(PlaneSamples(self.plane, partition, keys, ["advantages", *masks]), Whitening(mean, std))

    def optimize(self, step: int, samples: PlaneSamples) -> dict[str, float]:
        """The policy's optimizer steps (GRPO's), then the critic's on the same samples."""
        metrics = super().optimize(step, samples)
        critic_samples = PlaneSamples(samples.plane, samples.partition, samples.keys, CRITIC_FIELDS)
        parts = [self.critic.train_from(chunk, self.value_loss)
                 for chunk in critic_samples.chunks(self.ppo.critic.train_global_batch_size)]
        critic = combine_train_passes(parts, self.value_loss.metric_reductions)
        return {**metrics, **self.advantage_metrics, **{f"critic/{name}": value for name, value in critic.items()}}
