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


class WorkerError(PosttrainError):
    """A Ray worker died or failed; the message names its group and rank."""


def did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidate, or ``""`` if none is close.

    ``prefix`` is put before the suggestion only (e.g. the dotted path of a config level), so
    closeness is judged on the words themselves.
    """
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{prefix}{matches[0]}'?" if matches else ""
