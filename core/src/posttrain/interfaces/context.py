"""What a run gives its algorithm: :class:`RunContext`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig
    from posttrain.interfaces.data_plane import DataPlane
    from posttrain.interfaces.environment import Environment
    from posttrain.interfaces.generation import Generation
    from posttrain.interfaces.loss import LossFunction
    from posttrain.interfaces.policy import Policy


class RunContext(Protocol):
    """One run's services, as an :class:`~posttrain.interfaces.Algorithm` sees them (core's
    :class:`posttrain.run.context.RunContext` implements it). Builders start a backend's
    workers through the factory its registry holds under the name the config gives; the
    algorithm owns and shuts down what it builds.

    ``config`` is the run's config as loaded; ``run_dir`` its folder; ``log`` a structlog
    logger; ``checkpoints`` the run's checkpoint manager (None with checkpointing off)."""

    config: RunConfig
    run_dir: Path
    log: Any
    checkpoints: Any

    @property
    def stop_requested(self) -> bool:
        """True once SIGINT / SIGTERM arrived: save the last finished step and return."""

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint the run resumes from; None for a fresh run."""

    def start_cluster(self, *, colocate: bool = True) -> Any:
        """Start Ray and the run's virtual cluster once; return the cluster. ``colocate=False``:
        ``generation.colocated`` does not apply (a run whose engines share with no policy)."""

    def build_policy(
        self, *, schedule_steps: int | None = None, policy: PolicyConfig | None = None, name: str = "policy",
        reference: bool = True,
    ) -> Policy:
        """The ``policy.backend`` policy, its workers started (a second model under another ``name``)."""

    def build_generation(self, generation: GenerationConfig | None = None, *, host: Any = None) -> Generation:
        """The ``generation.backend`` engines (inside the ``host`` policy's workers with
        ``generation.in_policy_workers``)."""

    def build_data_plane(self) -> DataPlane:
        """The ``data_plane.backend`` data plane."""

    def build_loss(self, name: str, options: Any) -> LossFunction:
        """The loss registered as ``name``, built from the algorithm's typed ``options``."""

    def build_environments(self, names: Iterable[str], *, plugins: Sequence[str] = ()) -> Mapping[str, Environment]:
        """One environment per name, each in its own Ray actor."""

    def startup(self, cleanup: contextlib.ExitStack) -> Any:
        """A helper that builds the run's parts at the same time, their shutdown on ``cleanup``."""

    def log_metrics(self, step: int, metrics: Mapping[str, float], phase: str = "train") -> None:
        """Write ``metrics`` to every sink and tell the ``posttrain_step_end`` observers."""

    def progress(self, total: int, description: str, initial: int = 0) -> Any:
        """A progress bar over ``total`` units (off when ``logger.progress_bar`` is false)."""
