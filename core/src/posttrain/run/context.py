"""What an algorithm receives: the typed config, the plugin host, and builders for backends,
environments, data planes and losses, plus the run's metric logger, checkpoint manager and
progress bar."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.demands import check_demands_fit, run_demands, started_cluster_size, with_in_policy_workers
from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig
from posttrain.config.validate import in_policy_workers_by_default, policy_in_driver_by_default, where_set
from posttrain.errors import ConfigError, RunStopped, WorkerError
from posttrain.log import configure_logging, get_logger
from posttrain.models.folder import check_model_folders
from posttrain.plugins import PluginHost, plugin_host
from posttrain.run.checkpoint import CheckpointManager, check_checkpoint_fits, checkpoint_dir
from posttrain.run.finished import finished_unchanged
from posttrain.run.metrics import MetricLogger, ProgressBar
from posttrain.run.refit import refit
from posttrain.run.run_dir import prepare_run_dir, remove_created_run_dir
from posttrain.run.startup import Started, Startup
from posttrain.run.stop import StartupInterrupted, StoppedDuringStartup, StopRequest, stop_on_signals

if TYPE_CHECKING:
    from posttrain.distributed.cluster import VirtualCluster
    from posttrain.hookspecs import (
        DataPlaneFactory,
        GenerationBackendFactory,
        LossFactory,
        PolicyBackendFactory,
    )
    from posttrain.interfaces import DataPlane, Environment, Generation, LossFunction, Policy


#: Seconds :meth:`RunContext.close` waits, in all, for threads still starting parts of a run
#: that ended during its start-up (their actors were just removed, so they end quickly).
STARTUP_SETTLE_S = 1.0


def _hosts_engines(policy: Policy) -> bool:
    """Whether ``policy`` implements :meth:`~posttrain.interfaces.Policy.host_engines` (the
    interface's own refuses)."""
    from posttrain.interfaces import Policy

    return type(policy).host_engines is not Policy.host_engines


class RunContext:
    """One run's services. Backends and environments are built on request, each by the
    factory its registry holds under the name the config gives; the algorithm owns and shuts
    down what it builds. The Ray cluster starts on first use. ``config`` is the run's config
    as loaded; nothing here changes it.

    ``stop`` is set by SIGINT / SIGTERM during :func:`run_algorithm` (:mod:`posttrain.run.stop`).
    Until the steps begin, the builders, the cluster's start and :meth:`startup`'s wait check
    it and raise :class:`~posttrain.run.stop.StartupInterrupted`. A training loop calls
    ``stop.begin_steps()`` before its first validation or step, then checks
    :attr:`stop_requested` before each step and, once it is set, saves a checkpoint of the last
    finished step and returns."""

    def __init__(self, config: RunConfig, host: PluginHost | None = None, stop: StopRequest | None = None):
        self.config = config
        self.host = host or plugin_host()
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster_requested = False  # set once the run asks for its cluster: from then on Ray may run
        self.log = get_logger()
        self.metrics = MetricLogger.open(config, self.run_dir, self.host)
        ckpt = config.checkpointing
        self.checkpoints: CheckpointManager | None = (
            CheckpointManager(checkpoint_dir(config), ckpt.keep_top_k, ckpt.metric, ckpt.higher_is_better)
            if ckpt.enabled
            else None
        )
        self._cluster: VirtualCluster | None = None
        self._cluster_lock = threading.Lock()  # builders may run in threads (posttrain.run.startup)
        self._closed = False
        self._startups: list[Startup] = []
        self.stop = stop or StopRequest()

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint the run resumes from: the latest in ``checkpointing.dir`` when
        ``checkpointing.resume`` is on; None for a fresh run."""
        if self.checkpoints is None or not self.config.checkpointing.resume:
            return None
        return self.checkpoints.latest()

    @property
    def stop_requested(self) -> bool:
        """True once a stop signal arrived: end the loop at this step boundary and save."""
        return self.stop.requested

    @property
    def cluster(self) -> VirtualCluster:
        """The run's :class:`~posttrain.distributed.cluster.VirtualCluster`, starting Ray if needed."""
        return self.start_cluster()

    def start_cluster(self, *, colocate: bool = True) -> VirtualCluster:
        """Start Ray (unless this process is connected already) and the run's cluster, once,
        whichever thread asks first; return the cluster. Ray's start is not interrupted: a
        stop requested meanwhile is raised once it is up. The cluster waits for
        ``cluster.num_nodes`` nodes (a stop ends the wait), then every other node must see the
        run's folders (:meth:`check_storage`). With ``generation.colocated``, the generation
        group shares the policy's GPUs, or goes to its nodes (:func:`colocated_groups`),
        unless ``colocate`` is False: an algorithm whose engines share with no policy (the
        first call decides)."""
        self.stop.check_startup()
        with self._cluster_lock:
            if self._closed:
                raise WorkerError(f"the run in {self.run_dir} has ended; its cluster does not start again")
            if self._cluster is None:
                from posttrain.distributed.cluster import VirtualCluster, check_node_count, colocated_groups

                check_node_count(self.config.cluster)
                self.cluster_requested = True
                started_ray = self._start_ray()
                self._cluster = VirtualCluster(self.config.cluster, colocate=colocated_groups(self.config) if colocate else {},
                                               check=self.stop.check_startup, started_ray=started_ray)
                self.check_fits_cluster()
                self.check_storage()
        self.stop.check_startup()
        return self._cluster

    def check_fits_cluster(self) -> None:
        """The run's parts (:func:`~posttrain.config.demands.run_demands`) fit the cluster
        it is connected to, added up (a cluster it joined, or GPUs Ray detected: what the
        check before Ray, :func:`check_inputs`, could not know)."""
        import ray

        from posttrain.distributed.nodes import cluster_address

        size = {key: value for key, value in ray.cluster_resources().items() if key in ("CPU", "GPU")}
        size.setdefault("GPU", 0.0)
        joined = None if self._cluster is not None and self._cluster.started_ray else cluster_address()
        check_demands_fit(self.config, run_demands(self.config, self.host), size, joined)

    def check_storage(self) -> None:
        """Every node of the cluster, other than the driver's, can write into and read from
        ``run_dir`` and the checkpoint folder
        (:func:`~posttrain.distributed.storage.check_shared_storage`)."""
        from posttrain.distributed.storage import check_shared_storage

        folders = {"run_dir": self.run_dir}
        if self.checkpoints is not None and self.config.checkpointing.dir is not None:
            folders["checkpointing.dir"] = Path(self.config.checkpointing.dir)
        check_shared_storage(folders)

    def build_policy(
        self,
        *,
        schedule_steps: int | None = None,
        policy: PolicyConfig | None = None,
        name: str = "policy",
        reference: bool = True,
    ) -> Policy:
        """The ``policy.backend`` policy, its workers started on :attr:`cluster`.

        ``schedule_steps`` is the run's number of optimizer steps, which only the algorithm
        knows: when ``policy.scheduler.total_steps`` is unset (its documented default, the
        run's length), the backend is given the config with it set to ``schedule_steps``
        (:meth:`~posttrain.config.RunConfig.with_schedule_horizon`); :attr:`config` stays as loaded.
        ``policy`` replaces the ``policy`` section for this model: e.g. the run's with
        ``head="value"`` for an algorithm that trains a reward model. ``policy.in_driver`` left
        null is decided here (:func:`~posttrain.config.validate.policy_in_driver_by_default`)
        and the backend gets the config with the decision. A second model of the
        run (a critic, a teacher) is built under another worker-group ``name``; the backend
        checks its section as a policy of its own (the config it gets names no algorithm: the
        algorithm's batch rules are about the run's policy). ``reference`` False: the run never
        asks this model for reference logprobs, and its workers keep no copy of the initial
        weights for them."""
        self.stop.check_startup()
        config = self.config if policy is None else attrs.evolve(self.config, policy=policy)
        if name != "policy":
            config = attrs.evolve(config, algorithm=None)
        config = config if schedule_steps is None else config.with_schedule_horizon(schedule_steps)
        if config.policy.in_driver is None:
            in_driver = policy_in_driver_by_default(config, self.host)
            if in_driver:
                self.log.info("policy worker inside the driver's process", group=name, setting="policy.in_driver: null")
            config = attrs.evolve(config, policy=attrs.evolve(config.policy, in_driver=in_driver))
        factory: PolicyBackendFactory = self.host.policy_backends[config.policy.backend]
        return factory(config, self.cluster, name=name, reference=reference)

    def build_generation(
        self, generation: GenerationConfig | None = None, *, host: Started[Policy] | Policy | None = None
    ) -> Generation:
        """The ``generation.backend`` generation backend, its engines started on :attr:`cluster`;
        ``generation`` replaces the run's ``generation`` section for it (:attr:`config` stays as
        loaded). ``host`` is the run's policy (or the part starting it): with
        ``generation.in_policy_workers`` the engines are built inside its workers once it is up
        (the factory is called with ``host=policy``); a run without one refuses that setting.
        Left null, the setting is decided here (:func:`~posttrain.config.validate.in_policy_workers_by_default`,
        and a policy that can host engines) and the factory gets the config with the decision."""
        self.stop.check_startup()
        config = self.config if generation is None else attrs.evolve(self.config, generation=generation)
        factory: GenerationBackendFactory = self.host.generation_backends[config.generation.backend]
        chosen = config.generation.in_policy_workers
        if chosen is None:
            chosen = host is not None and in_policy_workers_by_default(config, self.host)
        if not chosen:
            return factory(with_in_policy_workers(config, False), self.cluster)
        if host is None:
            raise ConfigError(
                "generation.in_policy_workers is true, but this run's generation engines have no policy to run in "
                f"(algorithm {config.algorithm!r} trains none); set generation.in_policy_workers: false"
                f"{where_set(config, 'generation.in_policy_workers')}"
            )
        policy = host.wait_value(self.stop.check_startup) if isinstance(host, Started) else host
        if config.generation.in_policy_workers is None:
            if not _hosts_engines(policy):
                return factory(with_in_policy_workers(config, False), self.cluster)
            self.log.info("generation engines inside the policy's workers", backend=config.generation.backend,
                          setting="generation.in_policy_workers: null")
        hosted = factory(with_in_policy_workers(config, True), self.cluster, host=policy)
        # the engines take the policy's weights at once: one that can keep them frees the copy it loaded
        refit(policy, hosted, config.generation.refit_bucket_bytes)
        return hosted

    def build_data_plane(self) -> DataPlane:
        """The ``data_plane.backend`` data plane."""
        self.stop.check_startup()
        factory: DataPlaneFactory = self.host.data_planes[self.config.data_plane.backend]
        return factory(self.config)

    def build_loss(self, name: str, options: Any) -> LossFunction:
        """The loss registered as ``name``, built from the algorithm's typed ``options``."""
        factory: LossFactory = self.host.losses[name]
        return factory(options)

    def build_environments(self, names: Iterable[str], *, plugins: Sequence[str] = ()) -> Mapping[str, Environment]:
        """One environment per name in ``names``, each in its own Ray actor
        (:class:`~posttrain.run.environments.RemoteEnvironment`) or, where
        ``environments.<name>.in_driver`` says so, in this process
        (:class:`~posttrain.run.environments.LocalEnvironment`), built from the options under
        ``environments.<name>``. Ray starts with the run's cluster settings if it is not
        running yet. Every name in ``names`` and under ``environments`` must be registered:
        an unknown one fails before any actor starts. ``plugins`` are extra plugin modules
        (importable names) registered in every environment actor, for environments not
        installed as distributions. The caller shuts each environment down."""
        from posttrain.run.environments import start_environments

        self.start_cluster()  # checks for a stop too
        return start_environments(names, self.config.environments, plugins=plugins)

    def startup(self, cleanup: contextlib.ExitStack) -> Startup:
        """A :class:`~posttrain.run.startup.Startup` that builds the run's parts (the
        builders above) at the same time, their shutdown on ``cleanup``. When the run ends
        during start-up, :meth:`close` gives the threads still starting parts
        :data:`STARTUP_SETTLE_S` to end after the cluster's actors were removed. Its wait
        raises :class:`~posttrain.run.stop.StartupInterrupted` as soon as a stop is
        requested."""
        startup = Startup(cleanup, self.stop.check_startup)
        self._startups.append(startup)
        return startup

    def log_metrics(self, step: int, metrics: Mapping[str, float], phase: str = "train") -> None:
        """Write ``metrics`` to every sink, then tell the ``posttrain_step_end`` observers."""
        self.metrics.log(step, metrics, phase)
        self.host.hook.posttrain_step_end(step=step, metrics=dict(metrics), phase=phase)

    def progress(self, total: int, description: str, initial: int = 0) -> ProgressBar:
        return ProgressBar(total, description, enabled=self.config.logger.progress_bar, initial=initial)

    def close(self) -> None:
        """Close the metric sinks and release the cluster's placement groups; after it no
        cluster starts (a builder still running in a thread fails instead of starting Ray
        again)."""
        self.metrics.close()
        with self._cluster_lock:
            self._closed = True
            if self._cluster is not None:
                self._cluster.shutdown()
        deadline = time.monotonic() + STARTUP_SETTLE_S
        for startup in self._startups:
            startup.settle(max(0.0, deadline - time.monotonic()))

    def _start_ray(self) -> bool:
        """Connect this process to Ray unless it is (:func:`~posttrain.distributed.cluster.init_ray`);
        whether the run started a local cluster."""
        import ray

        from posttrain.distributed.cluster import init_ray

        connected, began = ray.is_initialized(), time.perf_counter()
        started = init_ray(self.config.cluster)
        if not connected:
            self.log.info("Ray started", seconds=round(time.perf_counter() - began, 2))
        return started


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy (if present) and torch; optionally force deterministic kernels."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True)


def check_inputs(config: RunConfig, context: RunContext) -> None:
    """What the driver checks before any worker starts: the model folders, that the
    checkpoint a run would resume from was written by a compatible config, and that the
    run's parts fit the Ray cluster it will start (:mod:`posttrain.config.demands`; a
    cluster it joins, or one already running in this process, is checked once connected,
    :meth:`RunContext.check_fits_cluster`)."""
    check_model_folders(config)
    import ray

    from posttrain.distributed.cluster import joined_address

    if not (joined_address(config.cluster) or ray.is_initialized()):
        check_demands_fit(config, run_demands(config, context.host), started_cluster_size(config))
    latest = context.resume_checkpoint()
    if latest is not None:
        check_checkpoint_fits(latest, config)


def run_algorithm(config: RunConfig, host: PluginHost | None = None) -> dict[str, Any]:
    """Run ``config.algorithm`` to completion and return its final metrics.

    A run that already finished with this config returns at once, starting nothing
    (:func:`~posttrain.run.finished.finished_unchanged`; the run hooks are not called).
    ``run_dir`` must be writable (:func:`~posttrain.run.run_dir.prepare_run_dir`); a run
    that created it and fails before asking for its cluster (a refusal) removes it again.
    Inputs are checked first (:func:`check_inputs`). SIGINT and SIGTERM stop the run
    (:mod:`posttrain.run.stop`): during start-up at once, raising
    :class:`~posttrain.run.stop.StoppedDuringStartup`; once the steps began, at the next step
    boundary after a checkpoint, raising :class:`~posttrain.errors.RunStopped` once the
    algorithm saved and shut down (both are ``RunStopped``). Calls the
    ``posttrain_run_start`` / ``posttrain_run_end`` hooks around the run; the end hook
    learns whether the run completed, was interrupted or failed.
    """
    stop = StopRequest()
    context: RunContext | None = None
    created = False
    with stop_on_signals(stop):
        try:
            try:
                host = host or plugin_host()
                algorithm = host.algorithms[config.algorithm or ""]()
                created = prepare_run_dir(config)
                configure_logging(config.logger.level, Path(config.run_dir) / "events.jsonl")
                seed_everything(config.seed, config.deterministic)
                context = RunContext(config, host, stop)
                try:
                    finished = finished_unchanged(context)
                    if finished is not None:
                        context.close()
                        return finished
                    check_inputs(config, context)
                    stop.check_startup()
                except BaseException:
                    context.close()
                    raise
                return _run(algorithm, context)
            except StartupInterrupted as interrupted:
                resumes_from = None if context is None else context.resume_checkpoint()
                checkpoint = None if resumes_from is None else str(resumes_from)
                raise StoppedDuringStartup(stop.signal_name, 128 + interrupted.signum, checkpoint) from None
        except BaseException:
            if created and (context is None or not context.cluster_requested):  # refused: leave no folder behind
                configure_logging(config.logger.level)  # closes events.jsonl
                remove_created_run_dir(config.run_dir)
            raise


def _run(algorithm: Any, context: RunContext) -> dict[str, Any]:
    """``algorithm.run(context)`` between the run hooks; the context is closed at the end."""
    config, host = context.config, context.host
    host.hook.posttrain_run_start(config=config, run_dir=str(context.run_dir))
    status = "failed"
    try:
        result = algorithm.run(context)
        if context.stop_requested:
            status = "interrupted"
            stop = context.stop
            raise RunStopped(stop.signal_name, 128 + (stop.signum or 0), int(result.get("step", 0)), _latest_checkpoint(context))
        status = "completed"
        return result
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        host.hook.posttrain_run_end(config=config, run_dir=str(context.run_dir), status=status)
        context.close()


def _latest_checkpoint(context: RunContext) -> str | None:
    latest = context.checkpoints.latest() if context.checkpoints is not None else None
    return None if latest is None else str(latest)
