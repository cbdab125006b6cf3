"""Why a checkpoint could not be written, when the reason is a full file system.

A full disk rarely says so by the time the error reaches the driver: torch's archive writer
in a policy worker reports ``[enforce fail at inline_container.cc:...] . unexpected pos 704
vs 598``. :func:`disk_full_error` recognises the case (``ENOSPC`` or ``EDQUOT`` anywhere in
the error's chain or text, or less free space left than the checkpoint needs) and words it
with the folder, the free space and the size a checkpoint of the run takes.
"""

from __future__ import annotations

import errno
import math
import shutil
from pathlib import Path

from posttrain.errors import CheckpointError

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def folder_bytes(folder: Path) -> int:
    """Bytes in the files under ``folder`` (0 when it does not exist)."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.exists() else 0


def disk_full_error(error: BaseException, directory: Path, step: int, written: int, previous: Path | None) -> CheckpointError | None:
    """A :class:`CheckpointError` saying that the file system of ``directory`` is full, when
    it is the reason ``error`` stopped checkpoint ``step`` after ``written`` bytes; None
    otherwise. ``previous`` is the run's last complete checkpoint (its size is what the new
    one needs), if any. Call it before the partial folder is removed (its bytes still take
    the space)."""
    needed = folder_bytes(previous) if previous is not None else 0
    free = shutil.disk_usage(directory).free
    said_full = _says_full(error)
    if not said_full and free >= max(needed - written, 1):
        return None
    size = (f"a checkpoint of this run takes {_size(needed)} ({previous.name})" if previous is not None
            else f"this checkpoint had written {_size(written)} when it failed, and needs more")
    kept = f"the previous checkpoint {previous} is intact" if previous is not None else "no earlier checkpoint exists"
    return CheckpointError(
        f"checkpoint step {step} could not be written: the file system of {directory} is full ({_size(free)} free); "
        f"{size}. The partial folder tmp_step_{step} was removed and {kept}. Free space there, point "
        f"checkpointing.dir at a file system with room, or keep fewer checkpoints (checkpointing.keep_top_k); then run "
        f"the same command again to resume. The error: {type(error).__name__}: {' '.join(str(error).split())}"
    )


def _says_full(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 10:
        if getattr(error, "errno", None) in _FULL_ERRNOS or any(text in str(error) for text in _FULL_TEXTS):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} bytes"
    power = min(int(math.log(count, 1024)), 3)
    return f"{count / 1024**power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"
