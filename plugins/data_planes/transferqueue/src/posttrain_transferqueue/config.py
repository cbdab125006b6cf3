"""The ``data_plane.transferqueue`` config section: how the TransferQueue plane starts.

Used when ``data_plane.backend: transferqueue``.
"""

from __future__ import annotations

import sys
from typing import ClassVar

import attrs

from posttrain.config.demands import Demand
from posttrain.config.requirements import Requirement
from posttrain.config.schema import RunConfig
from posttrain.config.validate import where_set
from posttrain.errors import ConfigError

SECTION = "data_plane.transferqueue"


@attrs.define
class TransferQueueConfig:
    """Options of the ``transferqueue`` data plane.

    - ``num_storage_units``: SimpleStorage actors holding the samples. TransferQueue starts
      one controller actor plus one actor per unit, each asking Ray for 1 CPU, so Ray needs
      ``1 + num_storage_units`` free logical CPUs.
    - ``storage_capacity``: most samples held across all units at once (None: unlimited).
      A put past it fails with TransferQueue's capacity error.
    - ``init_timeout_s``: how long starting (or attaching to) TransferQueue may take before
      the plane gives up with an error naming what it asked Ray for and what Ray has.
    - ``namespace``: prefix of this run's partitions inside TransferQueue, so runs sharing a
      Ray cluster never see each other's samples. None: derived from ``run_dir``, so a
      restarted run finds (and clears) what a crashed run with the same ``run_dir`` left.
    """

    requires: ClassVar[tuple[Requirement, ...]] = (
        Requirement("transfer_queue", "pip install 'transferqueue>=0.1.11'", distribution="transferqueue", minimum="0.1.11"),
    )

    num_storage_units: int = 1
    storage_capacity: int | None = None
    init_timeout_s: float = 120.0
    namespace: str | None = None

    @property
    def cpus_needed(self) -> int:
        """Logical CPUs TransferQueue's actors ask Ray for: the controller and each storage unit take 1."""
        return 1 + self.num_storage_units

    def cluster_demands(self, config: RunConfig) -> list[Demand]:
        """TransferQueue's controller and storage units (:mod:`posttrain.config.demands`);
        none when the Ray cluster this process is connected to runs a controller already (the
        plane attaches to it)."""
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            from posttrain_transferqueue.runtime import controller_running

            if controller_running():
                return []
        return [Demand("TransferQueue", tuple({"CPU": 1.0} for _ in range(self.cpus_needed)),
                       (f"{SECTION}.num_storage_units",))]


def check(options: TransferQueueConfig, config: RunConfig | None = None) -> None:
    """Raise :class:`ConfigError` naming the key of the first impossible option (and where
    the loader saw it set, when ``config`` is given)."""
    problems = {
        "num_storage_units": ("must be at least 1", options.num_storage_units < 1),
        "storage_capacity": (
            "must be at least 1 sample or null",
            options.storage_capacity is not None and options.storage_capacity < 1,
        ),
        "init_timeout_s": ("must be positive", options.init_timeout_s <= 0),
    }
    for name, (expected, bad) in problems.items():
        if bad:
            key = f"{SECTION}.{name}"
            raise ConfigError(f"{key} {expected}, got {getattr(options, name)}.{where_set(config, key)}")
