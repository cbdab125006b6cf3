"""The ``ppo`` config section and its checks. Imports only attrs and core's config: the
plugin module declaring it stays light."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from posttrain.config.demands import Demand, policy_demand
from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.config.validate import where_set


@attrs.define
class PPOConfig:
    """Options of the ``ppo`` algorithm: the critic and the advantage estimate. Everything
    else of a step (prompts, generations per prompt, steps, validation, the clipped policy
    loss and its KL penalty, asynchronous rounds, the export) is GRPO's and read from the
    ``grpo`` section; PPO replaces GRPO's group advantages with GAE over the critic's values."""

    # the critic: model ("" = policy.model, given a new value head), dtype, parallel sizes, batch sizes,
    # optimizer, schedule and resources, as the policy section has them; policy.head is set to value
    critic: PolicyConfig = attrs.field(factory=PolicyConfig)
    gamma: float = 1.0  # discount per generated token, in [0, 1]
    lam: float = 0.95  # GAE's lambda in [0, 1]: 1 gives Monte-Carlo returns minus the value, 0 one-step TD errors
    # the critic's new values stay within this distance of its values at rollout time (the larger of the
    # clipped and unclipped squared errors is trained); None: no clipping
    value_clip: float | None = 0.2
    normalize_advantages: bool = True  # whiten the advantages over the valid tokens of the step's batch

    #: Other algorithms' top-level sections a ``ppo`` run reads (``posttrain config show`` lists them).
    reads_sections: ClassVar[tuple[str, ...]] = ("grpo",)
    carries_routed_experts: ClassVar[bool] = True  # GRPO's passes: the rollouts' and previous pass's experts

    def cluster_demands(self, config: RunConfig) -> list[Demand]:
        """GRPO's parts, and the critic's workers."""
        from posttrain_grpo.config import grpo_demands

        return [*grpo_demands(config), policy_demand(self.critic, name="critic", prefix="ppo.critic")]


def check_ppo_config(options: PPOConfig, config: Any) -> list[str]:
    """Problems with the ``ppo`` section of ``config`` (a RunConfig), each naming its key,
    what was expected and what was found, and where the key was set."""
    problems = []

    def problem(message: str, *keys: str) -> None:
        problems.append(message + where_set(config, *keys))

    for name in ("gamma", "lam"):
        value = getattr(options, name)
        if not 0.0 <= value <= 1.0:
            problem(f"ppo.{name}: expected a value in [0, 1], found {value}.", f"ppo.{name}")
    if options.value_clip is not None and not options.value_clip > 0:
        problem(f"ppo.value_clip: expected a positive distance, or null for none, found {options.value_clip}.",
                "ppo.value_clip")
    grpo = config.sections.get("grpo")
    critic_gbs = options.critic.train_global_batch_size
    if grpo is not None and critic_gbs >= 1 and grpo.samples_per_step % critic_gbs:
        problem(
            f"ppo.critic.train_global_batch_size: a step's {grpo.samples_per_step} samples (grpo.num_prompts_per_step "
            f"x grpo.num_generations_per_prompt) are not a multiple of it ({critic_gbs}); choose one that divides "
            f"{grpo.samples_per_step}.", "ppo.critic.train_global_batch_size",
        )
    return problems
