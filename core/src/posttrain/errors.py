"""Exceptions posttrain raises for problems a user can fix.

Each message names what is wrong (a config key, a file and line, a plugin name), what was
expected, what was found, and the fix when there is one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PosttrainError(Exception):
    """Base class of every error posttrain raises on purpose."""


class ConfigError(PosttrainError):
    """A configuration value or key is wrong."""


class PluginError(PosttrainError):
    """A plugin is missing, duplicated or misbehaving."""


class DataError(PosttrainError):
    """An input data file or row is malformed."""


class CheckpointError(PosttrainError):
    """A checkpoint is missing, incomplete or does not fit the config."""


class ClusterError(PosttrainError):
    """The Ray cluster lacks what a run needs: nodes that did not join, a node that cannot
    reach the run's storage, resources no node has."""


class WorkerError(PosttrainError):
    """A Ray worker died or failed; the message names its group and rank."""


class ProcessDied(WorkerError):
    """Another process of the run died under a worker's call (a generation engine during a
    weight sync, a data-plane actor): raised by the worker that saw it, and kept as this type
    when it reaches the driver, so the run restarts as for a worker that died itself."""


class NodeLost(WorkerError):
    """A worker of the run died with its node (the Ray cluster marked the node dead). Never
    contained: the run stops, naming the node, and resumes from its checkpoint when started
    again on a whole cluster."""


class RunStopped(Exception):
    """A run stopped early on a signal, after saving what it could (not an error: the run
    resumes from ``checkpoint`` when started again with the same config)."""

    def __init__(self, signal_name: str, exit_code: int, step: int, checkpoint: str | None):
        self.signal_name, self.exit_code, self.step, self.checkpoint = signal_name, exit_code, step, checkpoint
        saved = f"the checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpointing is off or no step finished)"
        super().__init__(
            f"stopped by {signal_name} after step {step}; the run resumes from {saved} when started again"
        )


def did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidate, or ``""`` if none is close.

    ``prefix`` is put before the suggestion only (e.g. the dotted path of a config level), so
    closeness is judged on the words themselves.
    """
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{prefix}{matches[0]}'?" if matches else ""
