"""The train/inference mismatch guard: a step whose generation engine scored its own samples
far from the trainer's logprobs for the same weights warns, or stops the run.

On policy, the two sides compute the same function: any gap beyond numerics means the
engine samples from another model than the one being trained (a feature of the
architecture one side ignores, weights that did not land at the refit, different dtypes),
and the policy gradient is then biased with no other sign in the logs.
"""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.errors import PosttrainError
from posttrain_grpo.config import MismatchGuardConfig

#: The guarded training metrics.
GUARDED = ("token_mult_prob_error", "mismatch_kl")


def is_mismatch_metric(name: str) -> bool:
    """Whether training metric ``name`` compares the engine's logprobs with the trainer's
    (:func:`posttrain_grpo.importance.mismatch_metrics` and its buckets)."""
    return name == "token_mult_prob_error" or name.startswith("mismatch")


def first_update_mismatch(parts: list[dict[str, float]]) -> list[dict[str, float]]:
    """The training passes of one step (one per optimizer update) with the mismatch metrics
    kept in the first only. In bypass mode (``rollout_correction: bypass``) the trainer's side
    of them is the logprobs being trained: after the step's first update those are another
    policy's, and the gap measures the update, not the engine."""
    return [parts[0], *({k: v for k, v in part.items() if not is_mismatch_metric(k)} for part in parts[1:])]

LIKELY_CAUSES = (
    "an attention or output feature of the model that the engine or the trainer does not honour "
    "(sliding windows, soft-capping), a refit whose weights did not all land in the engine "
    "(tied embeddings, renamed or stacked expert weights), different dtypes on the two sides "
    "(generation.dtype against policy.dtype), or samples generated many weight versions ago "
    "(grpo.asynchronous.max_staleness_steps)"
)


class MismatchTooLarge(PosttrainError):
    """The generation engine's logprobs are beyond a stop bound of ``grpo.mismatch_guard``."""


def check_mismatch(step: int, metrics: Mapping[str, float], guard: MismatchGuardConfig) -> list[str]:
    """Warnings for the guarded metrics of step ``step`` beyond their warn bounds; raises
    :class:`MismatchTooLarge` for the first beyond its stop bound. Metrics absent from
    ``metrics`` (a loss without generation logprobs) are not checked."""
    warnings = []
    for name in GUARDED:
        if name not in metrics:
            continue
        value = metrics[name]
        stop, warn = getattr(guard, f"stop_{name}"), getattr(guard, f"warn_{name}")
        if stop is not None and not value <= stop:  # NaN stops too
            raise MismatchTooLarge(
                f"GRPO step {step}: {name} is {value:.6g}, beyond grpo.mismatch_guard.stop_{name} ({stop}): the "
                f"generation engine's logprobs of its own samples are far from the trainer's for the same "
                f"weights, so the policy gradient is not that of the model being trained. Likely causes: "
                f"{LIKELY_CAUSES}. The step's optimizer update has run; the run stops here without saving "
                f"a checkpoint. To train on anyway, raise grpo.mismatch_guard.stop_{name} or set it to null."
            )
        if warn is not None and value > warn:
            warnings.append(f"{name} is {value:.6g}, beyond grpo.mismatch_guard.warn_{name} ({warn})")
    return warnings
