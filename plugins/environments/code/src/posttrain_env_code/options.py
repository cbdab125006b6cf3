"""Options of the ``code`` environment (the mapping under ``environments.code``), declared
on its factory in :mod:`posttrain_env_code.plugin` and read by core like a config section.
Torch-free: the plugin module imports this at entry-point load."""

from __future__ import annotations

from typing import Literal

import attrs

from posttrain.config.environments import at_least


@attrs.frozen
class CodeOptions:
    """Options of the ``code`` environment (``environments.code``). A sample's ``tests`` run
    together as one sandbox run, each of its ``cases`` as a run of its own.

    - ``timeout_s``: wall-clock seconds of one run (at least 0.1); a run past it is killed and
      counts as a timeout.
    - ``memory_mb``: address space of each process of a run (``RLIMIT_AS``), MiB; at least 64.
    - ``max_output_bytes``: stdout and stderr of one run together; a run writing more is stopped.
    - ``max_processes``: processes and threads of one run (``RLIMIT_NPROC``); at least 4.
    - ``disk_mb``: size of a run's work folder (and of its largest file), MiB.
    - ``max_concurrency``: runs at once (threads of the environment's actor).
    - ``namespaces``: Linux namespaces that cut a run off the network and the filesystem:
      ``auto`` uses them when they work on this machine (and warns when not), ``require``
      fails without them, ``off`` never uses them.
    - ``reward``: ``fraction`` of the tests and cases passed, or ``all`` (1 only when every
      one passes).
    """

    timeout_s: float = attrs.field(default=10.0, validator=at_least(0.1))
    memory_mb: int = attrs.field(default=512, validator=at_least(64))
    max_output_bytes: int = attrs.field(default=1 << 20, validator=at_least(1))
    max_processes: int = attrs.field(default=16, validator=at_least(4))
    disk_mb: int = attrs.field(default=16, validator=at_least(1))
    max_concurrency: int = attrs.field(default=2, validator=at_least(1))
    namespaces: Literal["auto", "require", "off"] = "auto"
    reward: Literal["fraction", "all"] = "fraction"
