"""Draw a run's reward and validation-accuracy curves to a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.errors import ConfigError


def plot_curves(path: str | Path, train: Sequence[dict[str, Any]], validation: Sequence[dict[str, Any]],
                reward_key: str, accuracy_key: str, title: str) -> Path:
    """Plot ``reward_key`` of each training record and ``accuracy_key`` of each validation
    record against the step; write the figure to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("the quickstart plot needs matplotlib: pip install matplotlib") from exc
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in train if reward_key in r]
    left.plot(steps, [r[reward_key] for r in train if reward_key in r], marker=".")
    left.set(title="mean reward per GRPO step", xlabel="step", ylabel="reward")
    right.plot([r["step"] for r in validation], [r[accuracy_key] for r in validation], marker="o", color="tab:green")
    right.set(title="validation accuracy", xlabel="step", ylabel="accuracy", ylim=(0, 1))
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
