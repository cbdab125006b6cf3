"""The benchmarks' results files, ``benchmarks/results/NAME.json``: one table of
docs/benchmarks.md each, which ``report.py`` writes into the page.

A results file holds:

- ``title``, ``conditions`` (what every run of the table shares: model, batch, precision)
  and ``machine``;
- ``baseline``: the side the ``time / baseline`` column divides by (absent for tables
  without sides); ``run_header``: the heading of the column that tells runs apart (when the
  table has several runs); ``columns``: the fields the table shows, in :data:`COLUMNS`
  order (absent: every field a row has); ``notes``: lines printed under the table;
- ``runs``, each with ``label``, ``command`` (the command line that measured it), ``date``,
  ``details`` (load, machine rates), ``source`` (how the numbers got into the file) and
  ``rows``: one per side, of the fields of :data:`COLUMNS`.

A benchmark run given ``--record NAME`` (and ``--run LABEL`` for the harness's workloads)
writes its run into the file (:func:`save`), replacing the run of the same label and keeping
the others.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Column:
    """A field of a results row: its heading, how a number is printed (a format spec; None:
    as stored) and whether it is text (left-aligned)."""

    heading: str
    fmt: str | None = None
    text: bool = False


#: Every field a results row may hold, in the order tables show them. ``vs_baseline`` is not
#: stored: the report divides a row's time by its run's baseline row's (the baseline's is 1.00).
COLUMNS: dict[str, Column] = {
    "side": Column("side", text=True),
    "seed": Column("seed"),
    "repeat": Column("repetition"),
    "step_s": Column("step s (median)"),
    "step_s_min": Column("min"),
    "step_s_max": Column("max"),
    "call_s": Column("call s (median)"),
    "call_s_min": Column("min"),
    "call_s_max": Column("max"),
    "refit_s": Column("refit s (median)"),
    "refit_s_min": Column("min"),
    "refit_s_max": Column("max"),
    "error": Column("error", text=True),
    "vs_baseline": Column("vs baseline", fmt=".2f"),
    "tokens_per_s": Column("tokens/s"),
    "lengths": Column("length mean / p50 / p90 / max", text=True),
    "at_budget": Column("at budget", text=True),
    "mb_moved": Column("MB moved"),
    "generation_s": Column("generation s"),
    "environment_s": Column("environment s"),
    "training_s": Column("training s"),
    "training_over_floor": Column("training / floor"),
    "refit_stage_s": Column("refit s"),
    "rollout_wait_s": Column("rollout wait s"),
    "estimate": Column("estimate"),
    "floor_s": Column("floor s"),
    "time_over_floor": Column("time / floor"),
    "before_ray_s": Column("before Ray s"),
    "ray_s": Column("Ray s"),
    "workers_s": Column("workers s"),
    "first_step_s": Column("first step s"),
    "total_s": Column("total s"),
    "workers_by_part": Column("workers by part s", text=True),
    "before_sft": Column("before SFT", fmt=".3f"),
    "after_sft": Column("after SFT", fmt=".3f"),
    "after_grpo": Column("after GRPO", fmt=".3f"),
    "gain": Column("GRPO gain", fmt="+.3f"),
    "wall_s": Column("wall time s"),
    "trained_parameters": Column("trained parameters", text=True),
    "trained_mb": Column("trained weights MB"),
    "optimizer_mb": Column("optimizer state MB"),
    "refit_sends": Column("refit sends", text=True),
    "refit_mb": Column("refit MB"),
    "policy_worker_mb": Column("policy worker MB"),
    "engine_mb": Column("engine MB"),
    "driver_mb": Column("driver MB"),
    "environment_mb": Column("environment MB"),
    "peak_mb": Column("peak MB"),
    "ray_mb": Column("Ray MB"),
    "first_loss": Column("first loss"),
}
#: The time a row's ``vs_baseline`` divides, the first of these it has.
TIME_FIELDS = ("step_s", "call_s", "refit_s")

#: Harness summary field -> results field (the same number, rounded).
_SAME = {"step_s_median": "step_s", "step_s_min": "step_s_min", "step_s_max": "step_s_max",
         "call_s_median": "call_s", "call_s_min": "call_s_min", "call_s_max": "call_s_max",
         "refit_s_median": "refit_s", "tokens_per_s": "tokens_per_s", "time_over_floor": "time_over_floor",
         "peak_rss_mb": "peak_mb", "infra_rss_mb": "ray_mb", "error": "error"}
#: GRPO stage (``timing/<stage>``) -> results field.
_STAGES = {"generation": "generation_s", "environment": "environment_s", "training": "training_s",
           "refit": "refit_stage_s", "rollout_wait": "rollout_wait_s"}
#: A benchmark process's role (``common.process_role``) -> results field.
_ROLES = {"ray::DTensorPolicyWorker": "policy_worker_mb", "ray::VllmEngineWorker": "engine_mb",
          "ray::HFEngineWorker": "engine_mb", "driver": "driver_mb", "ray::EnvironmentActor": "environment_mb"}


#: Decimals a harness number is kept with, by results field (others: 3).
_DECIMALS = {"tokens_per_s": 0, "peak_mb": 0, "ray_mb": 0, "policy_worker_mb": 0, "engine_mb": 0, "driver_mb": 0,
             "environment_mb": 0, "mb_moved": 1, "trained_mb": 1, "optimizer_mb": 1, "refit_mb": 1,
             "time_over_floor": 2, "training_over_floor": 2, "first_loss": 5}


def _kept(field: str, value: float) -> float | int:
    decimals = _DECIMALS.get(field, 3)
    return round(value, decimals) if decimals else int(round(value))


def harness_rows(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of a harness summary (``common.finish``'s ``results.json``: SFT, DPO, GRPO,
    generation, refit, LoRA), one per side."""
    rows = []
    for side, s in result["sides"].items():
        row: dict[str, Any] = {"side": side}
        numbers: dict[str, float] = {}
        for key, field in _SAME.items():
            if isinstance(s.get(key), str):
                row[field] = s[key]
            elif key in s and s[key] == s[key]:  # NaN: not measured
                numbers[field] = s[key]
        if "first_loss" in s:
            numbers["first_loss"] = s["first_loss"]
        if "bytes_moved" in s:
            numbers["mb_moved"] = s["bytes_moved"] / 1e6
        if isinstance(s.get("lengths"), Mapping):  # generation: completion lengths
            n = s["lengths"]
            row["lengths"] = f"{n['mean']:.1f} / {n['median']:.0f} / {n['p90']:.0f} / {n['max']:.0f}"
            row["at_budget"] = f"{100 * n['at_budget']:.0f}%"
        stages, floors = s.get("stage_s_median", {}), s.get("stage_floor_s", {})
        for stage, field in _STAGES.items():
            if stage in stages:
                numbers[field] = stages[stage]
        if "training" in stages and floors.get("training"):
            numbers["training_over_floor"] = stages["training"] / floors["training"]
        for role, mb in s.get("rss_by_role", {}).items():
            if role in _ROLES:
                numbers[_ROLES[role]] = numbers.get(_ROLES[role], 0.0) + mb
        if "trained_parameters" in s:  # LoRA
            row["trained_parameters"] = f"{s['trained_parameters'] / 1e6:.2f}M of {s['parameters'] / 1e6:.2f}M"
            row["refit_sends"] = s["refit"]
            numbers.update(trained_mb=s["trained_bytes"] / 1e6, optimizer_mb=s["optimizer_state_bytes"] / 1e6,
                           refit_mb=s["refit_bytes"] / 1e6)
        rows.append({**row, **{field: _kept(field, value) for field, value in numbers.items()}})
    return rows


def harness_record(result: Mapping[str, Any], command: str, label: str | None = None) -> dict[str, Any]:
    """A results file of one run from a harness summary; the run's label by default names
    its form (if any) and its repetitions x timed steps."""
    reps = next(iter(result["sides"].values()))["reps"]
    label = label or ", ".join(filter(None, [result.get("form"), f"{reps} x {result['steps']} steps"]))
    loads = result["load_avg_1m"]
    rate = (f"float32 matmul {result['matmul_gflops']:.0f} GFLOP/s" if "matmul_gflops" in result
            else f"copy {result['copy_gb_per_s']:.1f} GB/s")
    form = f", {result['form']}" if result.get("form") else ""
    return {
        "title": f"{result['workload']}, model {result['model']}{form}",
        "conditions": f"model `{result['model']}` ({result['parameters'] / 1e6:.1f}M parameters), float32",
        "machine": result["machine"],
        "baseline": result["baseline"],
        "runs": [{
            "label": label, "command": command, "date": result["date"],
            "details": f"load {min(loads):.1f} to {max(loads):.1f}, {rate}",
            "source": "written by the benchmark (--record)", "rows": harness_rows(result),
        }],
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran, as a user types it from the repository root (``--out``,
    ``--record`` and ``--run`` and their values left out)."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(Path(argv[0]).resolve(), RESULTS.parents[1])
    kept, skip = [], False
    for word in argv[1:]:
        if skip:
            skip = False
        elif word in ("--out", "--record", "--run"):
            skip = True
        elif not word.startswith(("--out=", "--record=", "--run=")):
            kept.append(word)
    return shlex.join(["python", script, *kept])


def save(name: str, record: Mapping[str, Any], folder: Path = RESULTS) -> Path:
    """Write ``record``'s runs into ``folder/NAME.json``: each replaces the run of its label
    there or is added after the others; the other runs and the file's own title, conditions,
    columns and notes are kept."""
    path = folder / f"{name}.json"
    if not path.exists():
        kept = dict(record)
    else:
        kept = json.loads(path.read_text())
        for run in record["runs"]:
            labels = [r["label"] for r in kept["runs"]]
            if run["label"] in labels:
                kept["runs"][labels.index(run["label"])] = run
            else:
                kept["runs"].append(run)
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept, indent=1, ensure_ascii=False) + "\n")
    return path


def today() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
