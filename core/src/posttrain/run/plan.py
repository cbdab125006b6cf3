"""The shape of one run, as its algorithm plans it: :class:`LoopPlan`."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class LoopPlan:
    """The shape of one run, fixed by the algorithm from its options and its data."""

    label: str  # names the algorithm in the progress bar, the logs and resume errors ("GRPO", "sft")
    total_steps: int  # training steps planned; fewer when the data runs out first
    schedule_steps: int  # optimizer steps over the run: the policy's schedule horizon (RunContext.build_policy)
    val_period: int = 0  # steps between validations; 0: none during training
    val_at_start: bool = False
    val_at_end: bool = False
    export_dir: str | None = None  # write a Hugging Face folder of the final weights here
    length_keys: tuple[str, ...] = ()  # the config keys that set total_steps, named when a finished run is started again

    def record(self) -> dict[str, Any]:
        """The plan as saved in a checkpoint's ``training_info.json``: what decides whether a
        run started again has anything left to do."""
        return {"total_steps": self.total_steps, "val_at_end": self.val_at_end, "export_dir": self.export_dir}
