"""The run's folder (``run_dir``): checked writable before anything is written there, and
removed again when a run that created it is refused before its cluster started.

A refused run (a config, data or model error found before Ray starts) has written nothing
worth keeping: its error is printed, and an empty ``metrics.jsonl``, a ``checkpoints``
folder without checkpoints and the log of the refusal would only be left to confuse the
next look at the folder (or a resume). A folder that existed before the run is never removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from posttrain.config.schema import RunConfig
from posttrain.config.validate import where_set
from posttrain.errors import ConfigError

_PROBE = ".posttrain-write-check"


def prepare_run_dir(config: RunConfig) -> bool:
    """Create ``run_dir`` and check that files can be written in it; True when this call
    created it. Raises :class:`ConfigError` naming the folder, the system's reason and a
    writable folder to use instead (a read-only or full file system, no permission, a file
    in the way)."""
    path = Path(config.run_dir)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / _PROBE).write_bytes(b"")
        (path / _PROBE).unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        alternative = writable_alternative(path.name or "run")
        instead = f"e.g. run_dir={alternative}" if alternative else "writable by this user"
        raise ConfigError(
            f"run_dir: cannot write the run's files in {path.absolute()}: {reason} (errno {exc.errno}). Set run_dir to "
            f"a folder on a writable file system, {instead}.{where_set(config, 'run_dir')}"
        ) from None
    return created


def writable_alternative(name: str) -> Path | None:
    """A folder ``name`` under the first of the current folder's ``runs``, the home folder's
    ``posttrain_runs`` and the system's temporary folder whose nearest existing parent this
    process may write; None when none qualifies."""
    for base in (Path.cwd() / "runs", Path.home() / "posttrain_runs", Path(tempfile.gettempdir()) / "posttrain_runs"):
        existing = base
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK) and _accepts_writes(existing):
            return base / name
    return None


def _accepts_writes(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (root passes ``os.access`` on a read-only mount)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=_PROBE):
            return True
    except OSError:
        return False


def remove_created_run_dir(path: str | Path) -> None:
    """Remove a run folder this run created (see the module docstring); errors are ignored."""
    shutil.rmtree(path, ignore_errors=True)
