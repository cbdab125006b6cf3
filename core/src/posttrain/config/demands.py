"""What a run holds of its Ray cluster, added up before Ray starts.

A run starts its parts together and holds them to its end: the policy's workers, a second
model's (a critic, a teacher), the generation engines, a data plane's actors. When they need
more than the cluster has, each part alone may fit, and the last one to ask would wait for a
placement that never comes. :func:`check_demands_fit` refuses such a run at once, naming
every part, what it asks for, and the keys that size it.

Each part is a :class:`Demand`. The sections a run uses declare theirs through a
``cluster_demands(self, config) -> list[Demand]`` method: the algorithm's section (named
like the algorithm) for the models it trains and the engines it samples from
(:func:`policy_demand`, :func:`generation_demand`), and the selected backends' sections
(``policy.<backend>``, ``generation.<backend>``, ``data_plane.<backend>``) for anything more
they start. A part a section does not declare is not counted, so the check only refuses a run
that cannot fit. Imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import attrs

from posttrain.config.schema import PolicyConfig, RunConfig
from posttrain.config.validate import in_policy_workers_by_default, where_set
from posttrain.errors import ConfigError
from posttrain.plugins import PluginHost

#: The Ray resources the check adds up.
RESOURCES = ("CPU", "GPU")


@attrs.frozen
class Demand:
    """One part of a run that holds Ray resources from its start to its end."""

    part: str  # how messages name it: "worker group 'policy'", "TransferQueue"
    bundles: tuple[Mapping[str, float], ...]  # what it asks Ray for, e.g. one {"CPU": 1.0} per worker
    keys: tuple[str, ...]  # the config keys that size it, named in a refusal

    def total(self, resource: str) -> float:
        return sum(bundle.get(resource, 0.0) for bundle in self.bundles)

    def describe(self) -> str:
        """``worker group 'policy' 2 x {CPU: 1}``: the part and its bundles."""
        counts: dict[str, int] = {}
        for bundle in self.bundles:
            text = "{" + ", ".join(f"{key}: {value:g}" for key, value in sorted(bundle.items()) if value > 0) + "}"
            counts[text] = counts.get(text, 0) + 1
        return f"{self.part} " + " + ".join(f"{count} x {text}" for text, count in counts.items())


def with_in_policy_workers(config: RunConfig, chosen: bool) -> RunConfig:
    """``config`` with ``generation.in_policy_workers`` set to ``chosen``."""
    if config.generation.in_policy_workers is chosen:
        return config
    return attrs.evolve(config, generation=attrs.evolve(config.generation, in_policy_workers=chosen))


def _resource_keys(prefix: str, gpus: float) -> tuple[str, ...]:
    return (f"{prefix}.num_workers", f"{prefix}.resources.cpus", *((f"{prefix}.resources.gpus",) if gpus > 0 else ()))


def policy_demand(section: PolicyConfig, *, name: str = "policy", prefix: str = "policy") -> Demand:
    """The worker group ``name`` of a model trained with ``section`` (the run's ``policy``,
    or e.g. ``ppo.critic`` under ``prefix``): one bundle per worker, or per GPU. Its bundles
    are reserved whether or not its worker runs in the driver's process."""
    from posttrain.distributed.placement import Shape, layout

    r = section.resources
    shape = Shape(section.num_workers, r.cpus, r.gpus, ranks_per_bundle=section.tensor_parallel_size)
    return Demand(f"worker group '{name}'", layout(shape).bundles, _resource_keys(prefix, r.gpus))


def generation_demand(config: RunConfig, *, beside_policy: bool = True) -> Demand | None:
    """The ``generation`` worker group, or None when the engines run inside the policy's
    workers (``generation.in_policy_workers``, as resolved by :func:`run_demands`).
    Colocated engines on the policy's GPUs add only their CPUs (they share the policy's
    bundles). ``beside_policy`` False: the algorithm trains no policy next to them (eval), so
    they neither run in one nor share its GPUs."""
    from posttrain.distributed.placement import Shape, layout

    gen, policy = config.generation, config.policy
    r = gen.resources
    keys = _resource_keys("generation", r.gpus)
    if beside_policy and gen.in_policy_workers:
        return None
    if beside_policy and gen.colocated and r.gpus > 0 and policy.resources.gpus > 0:
        return Demand("worker group 'generation'", tuple({"CPU": r.cpus} for _ in range(gen.num_workers)),
                      keys[:2])
    shape = Shape(gen.num_workers, r.cpus, r.gpus, devices_per_worker=gen.tensor_parallel_size if r.gpus > 0 else 1)
    return Demand("worker group 'generation'", layout(shape).bundles, keys)


def run_demands(config: RunConfig, host: PluginHost) -> list[Demand]:
    """Every part of ``config``'s run that the sections in use declare (see the module doc),
    with ``generation.in_policy_workers`` left null resolved as a run resolves it."""
    if config.generation.in_policy_workers is None:
        config = with_in_policy_workers(config, in_policy_workers_by_default(config, host))
    names = [config.algorithm or "", f"policy.{config.policy.backend}", f"generation.{config.generation.backend}",
             f"data_plane.{config.data_plane.backend}"]
    demands: list[Demand] = []
    for name in names:
        declare = getattr(config.sections.get(name), "cluster_demands", None)
        if callable(declare):
            demands.extend(declare(config))
    return demands


def started_cluster_size(config: RunConfig) -> dict[str, float]:
    """The resources of the one-node Ray cluster a run starts itself: ``cluster.num_cpus``
    (all cores when null) and ``cluster.num_gpus`` (left out when null: Ray detects them)."""
    size = {"CPU": float(config.cluster.num_cpus if config.cluster.num_cpus is not None else os.cpu_count() or 1)}
    if config.cluster.num_gpus is not None:
        size["GPU"] = float(config.cluster.num_gpus)
    return size


def check_demands_fit(config: RunConfig, demands: Sequence[Demand], size: Mapping[str, float],
                      joined: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``demands`` add up to more of a resource than ``size``
    (a resource ``size`` leaves out is not checked). ``joined``: the address of a running
    cluster the run connected to (None: a cluster the run starts, sized by the config), for
    the fix the message gives."""
    for resource in RESOURCES:
        if resource not in size:
            continue
        asking = [d for d in demands if d.total(resource) > 0]
        need = sum(d.total(resource) for d in asking)
        if need <= size[resource] + 1e-9:
            continue
        field = f"num_{resource.lower()}s"
        keys = [key for d in asking for key in d.keys]
        parts = "; ".join(d.describe() for d in asking)
        lower = f"or lower what the parts ask for ({', '.join(dict.fromkeys(keys))})"
        if joined is None and resource == "GPU" and config.cluster.num_gpus is None:
            has = f"Ray found {size[resource]:g} on this machine (cluster.num_gpus: null)"
            fix = f"Run it on a machine with {need:g} GPUs, {lower}."
        elif joined is None:
            has = f"the Ray cluster the run starts has {size[resource]:g} (cluster.{field})"
            fix = f"Set cluster.{field}: {need:g}{' (logical CPUs may exceed the cores)' if resource == 'CPU' else ''}, {lower}."
        else:
            has = f"the Ray cluster at {joined} has {size[resource]:g}"
            fix = f"Add nodes with more {resource}s to that cluster, {lower}."
        raise ConfigError(
            f"The run's parts ask Ray for {need:g} {resource}s in all, but {has}: {parts}. They are held together "
            f"for the whole run, so the last to ask would wait for a placement that never comes; no worker was "
            f"started. {fix}"
            f"{where_set(config, *([] if joined else [f'cluster.{field}']), *keys)}"
        )
