"""Checkpoint folders: atomic writes, retention, and finding the latest for resume.

Layout under the checkpoint directory::

    step_12/               a complete checkpoint (renamed into place only when complete)
        config.yaml        the resolved run config
        training_info.json {"step": 12, "metrics": {...}} and what the saver adds (the loop:
                           "validated_step", "plan", and "finished" once the run completed)
        policy/            the algorithm's TrainingState: the policy's own checkpoint,
        dataloader.pt      the training data loader's position,
        rng.pt             the driver's random states
    tmp_step_13/           a save in progress (or one killed midway); never loaded
    pruned_step_9/         a checkpoint being deleted; never loaded
    replaced_step_12/      a checkpoint of the step being saved again; loaded back only when
                           the save died before its new ``step_12`` was in place

A save writes everything into ``tmp_step_N``, flushes it to disk, then renames it to
``step_N`` in one ``os.rename``. A checkpoint is deleted (pruned, or replaced by a new save
of its step) only after it has been renamed out of the ``step_N`` names, so a ``step_N``
folder is always complete. A process killed at any point leaves every other ``step_*``
untouched; the next manager removes what it left behind and puts back a replaced checkpoint
whose successor never landed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from posttrain.errors import CheckpointError
from posttrain.log import get_logger
from posttrain.run.checkpoint_space import disk_full_error, folder_bytes

if TYPE_CHECKING:
    from posttrain.interfaces.policy import Policy

_STEP_DIR = re.compile(r"^step_(\d+)$")
#: A checkpoint's record of itself; a folder without it is not a complete checkpoint.
INFO_FILE = "training_info.json"
#: Prefixes of checkpoint folders on their way out (see the module docstring).
PRUNED, REPLACED = "pruned_", "replaced_"


def checkpoint_dir(config: Any) -> Path:
    """Where a run keeps its checkpoints: ``checkpointing.dir``, else ``<run_dir>/checkpoints``."""
    return Path(config.checkpointing.dir or Path(config.run_dir) / "checkpoints")


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the complete checkpoints (``step_N`` folders) in ``directory``, ascending; none
    when it does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = (_STEP_DIR.match(p.name) for p in directory.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    steps = complete_steps(directory)
    return Path(directory) / f"step_{steps[-1]}" if steps else None


class CheckpointManager:
    """Saves ``step_N`` folders atomically and keeps the best ``keep_top_k``.

    Ranking uses ``metric`` from each checkpoint's metrics (higher is better unless
    ``higher_is_better`` is false); with no metric, newer is better. The newest checkpoint
    is always kept as well, so a run can resume even when it is not among the best.
    """

    def __init__(self, directory: str | Path, keep_top_k: int | None = 3, metric: str | None = None, higher_is_better: bool = True):
        if keep_top_k is not None and keep_top_k < 1:
            raise CheckpointError(f"checkpointing.keep_top_k must be at least 1 or null, found {keep_top_k}")
        self.directory = Path(directory)
        self.keep_top_k = keep_top_k
        self.metric = metric
        self.higher_is_better = higher_is_better
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_incomplete()

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        metrics: Mapping[str, float] | None = None,
        config_yaml: str | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step``: ``write(folder)`` fills the temporary folder, then it is
        renamed into place. ``training_info.json`` holds the step, ``metrics`` and the
        JSON-serialisable fields of ``info``. Returns the final folder. A write that raises
        removes the temporary folder; on a full file system it raises a
        :class:`CheckpointError` saying so (:func:`~posttrain.run.checkpoint_space.disk_full_error`)."""
        final = self.directory / f"step_{step}"
        tmp = self.directory / f"tmp_step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        previous = self.latest()
        try:
            tmp.mkdir(parents=True)
            write(tmp)
            if config_yaml is not None:
                (tmp / "config.yaml").write_text(config_yaml)
            record = {**(info or {}), "step": step, "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
            (tmp / INFO_FILE).write_text(json.dumps(record, indent=2))
            _fsync_tree(tmp)
        except Exception as exc:  # nothing of a failed save is kept; a full disk is said so
            full = disk_full_error(exc, self.directory, step, folder_bytes(tmp), previous)
            shutil.rmtree(tmp, ignore_errors=True)
            if full is not None:
                raise full from exc
            raise
        replaced = self.directory / f"{REPLACED}{final.name}"
        if final.exists():  # a step saved again (a run started over with resume off)
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        if replaced.exists():
            shutil.rmtree(replaced, ignore_errors=True)  # what remains, the next manager removes
        get_logger().info("checkpoint saved", step=step, path=str(final))
        self._prune()
        return final

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return complete_steps(self.directory)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.directory)

    def info(self, path: str | Path) -> dict[str, Any]:
        """The ``training_info.json`` of a checkpoint folder."""
        file = Path(path) / INFO_FILE
        if not file.exists():
            raise CheckpointError(f"{path} is not a complete checkpoint: {file.name} is missing")
        return json.loads(file.read_text())

    def update_info(self, step: int, fields: Mapping[str, Any]) -> None:
        """Add ``fields`` to the ``training_info.json`` of the complete checkpoint ``step``
        (e.g. that the run finished after it was saved). The file is replaced in one rename:
        a crash leaves the old or the new one."""
        folder = self.directory / f"step_{step}"
        record = {**self.info(folder), **fields}
        tmp = folder / (INFO_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, folder / INFO_FILE)
        _fsync_dir(folder)

    def _remove_incomplete(self) -> None:
        """Remove what a killed save or deletion left; put back a replaced checkpoint whose
        new save never landed (its deletion starts only once the new ``step_N`` is in place)."""
        for p in self.directory.glob(f"{REPLACED}step_*"):
            final = self.directory / p.name.removeprefix(REPLACED)
            if not final.exists():
                get_logger().warning("restoring a checkpoint whose new save did not complete", path=str(final))
                os.rename(p, final)
                _fsync_dir(self.directory)
        for pattern in ("tmp_step_*", f"{PRUNED}step_*", f"{REPLACED}step_*"):
            for p in self.directory.glob(pattern):
                get_logger().warning("removing incomplete checkpoint", path=str(p))
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        steps = self.steps()
        if self.keep_top_k is None or len(steps) <= self.keep_top_k:
            return
        keep = set(sorted(steps, key=self._rank_key, reverse=True)[: self.keep_top_k]) | {steps[-1]}
        for step in steps:
            if step not in keep:
                doomed = self.directory / f"{PRUNED}step_{step}"
                os.rename(self.directory / f"step_{step}", doomed)
                _fsync_dir(self.directory)
                shutil.rmtree(doomed, ignore_errors=True)

    def _rank_key(self, step: int) -> tuple[float, int]:
        if self.metric is None:
            return (0.0, step)
        value = self.info(self.directory / f"step_{step}")["metrics"].get(self.metric)
        if value is None:  # checkpoints without the metric rank below every scored one
            return (float("-inf"), step)
        return (value if self.higher_is_better else -value, step)


#: The files of a :class:`TrainingState` in a checkpoint folder.
POLICY_DIR = "policy"
DATALOADER_FILE = "dataloader.pt"
RNG_FILE = "rng.pt"


class LoaderPosition(Protocol):
    """What :class:`TrainingState` keeps of a data loader: its position (a
    :class:`~posttrain.data.StatefulDataLoader`, or a stream that tracks its own)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@attrs.frozen
class TrainingState:
    """What an algorithm's run carries across a resume, written into a checkpoint folder
    (``step_N/``, which :class:`CheckpointManager` completes with ``training_info.json`` and
    ``config.yaml``)::

        policy/         Policy.save_checkpoint: weights, optimizer, scheduler
        dataloader.pt   the training data loader's position (StatefulDataLoader.state_dict)
        rng.pt          the driver's Python, NumPy and torch random states (rng_state)

    A run with more state to carry (a PPO critic, say) subclasses it: its :meth:`save` and
    :meth:`load` add their own entries beside these.
    """

    policy: Policy
    loader: LoaderPosition

    def save(self, folder: Path) -> None:
        """Fill ``folder`` (see the class docstring)."""
        import torch

        self.policy.save_checkpoint(str(folder / POLICY_DIR))
        torch.save(self.loader.state_dict(), folder / DATALOADER_FILE)
        torch.save(rng_state(), folder / RNG_FILE)

    def load(self, folder: Path, algorithm: str) -> None:
        """Restore the policy, the loader's position and the driver's random states from a
        folder :meth:`save` filled. A folder without one of the files is refused before
        anything is restored, with a :class:`CheckpointError` naming what is missing and
        ``algorithm`` (the run's, as in the message: ``"GRPO"``)."""
        import torch

        missing = [name for name in (POLICY_DIR, DATALOADER_FILE, RNG_FILE) if not (folder / name).exists()]
        if missing:
            raise CheckpointError(
                f"checkpoint {folder} has no {', '.join(missing)}; it was not written by a {algorithm} run. "
                f"Point checkpointing.dir at a {algorithm} run's checkpoints, or set checkpointing.resume=false"
            )
        self.policy.load_checkpoint(str(folder / POLICY_DIR))
        self.loader.load_state_dict(torch.load(folder / DATALOADER_FILE))
        set_rng_state(torch.load(folder / RNG_FILE))


#: Config keys a checkpoint's state depends on: resuming with another value is refused.
RESUME_KEYS = ("algorithm", "policy.backend", "policy.dtype")
#: ``config.json`` fields that fix the shape of the model's weights.
MODEL_SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "tie_word_embeddings",
)


def check_checkpoint_fits(folder: str | Path, config: Any) -> None:
    """Refuse to resume ``config`` from the checkpoint ``folder`` when its saved
    ``config.yaml`` differs on :data:`RESUME_KEYS`, or its model (``policy.model``, when
    that folder still exists) differs in shape on :data:`MODEL_SHAPE_KEYS`.

    Raises :class:`CheckpointError` naming every differing key, the saved and the current
    value, and the ways out.
    """
    import yaml

    file = Path(folder) / "config.yaml"
    if not file.is_file():
        return
    saved = yaml.safe_load(file.read_text()) or {}
    differences = [
        f"{key}: checkpoint {_lookup(saved, key)!r}, config {_lookup_attr(config, key)!r}"
        for key in RESUME_KEYS
        if _lookup(saved, key) != _lookup_attr(config, key)
    ]
    saved_model, model = _lookup(saved, "policy.model"), config.policy.model
    if isinstance(saved_model, str) and saved_model != model:
        before, now = _model_shape(saved_model), _model_shape(model)
        if before is not None and now is not None:
            differences += [
                f"policy.model config.json {key}: checkpoint {before.get(key)!r} ({saved_model}), "
                f"config {now.get(key)!r} ({model})"
                for key in MODEL_SHAPE_KEYS
                if before.get(key) != now.get(key)
            ]
    if differences:
        raise CheckpointError(
            f"cannot resume from {folder}: it was written by a different config. Differences: "
            f"{'; '.join(differences)}. Start the new run in another checkpointing.dir (or run_dir), "
            "or resume with the checkpoint's settings"
        )


def _lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def _lookup_attr(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part, None)
    return config


def _model_shape(path: str) -> dict[str, Any] | None:
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return {key: data.get(key) for key in MODEL_SHAPE_KEYS} if isinstance(data, dict) else None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """The driver's random states (Python, NumPy's global generator, torch CPU), for an
    algorithm's ``rng.pt``; ``torch.load`` reads it back with ``weights_only=True``."""
    import random

    import numpy as np
    import torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
