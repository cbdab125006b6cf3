"""Start-up: the seconds from ``posttrain run`` to the first training step, and where they go.

    python benchmarks/startup.py [--repeats 3] [--algorithms grpo grpo-processes sft] [--out FILE] [--record NAME]

Each repetition runs ``python -m posttrain.cli run ALGORITHM`` on the tiny model (built in
a temporary folder, nothing downloaded) from the example config, in a fresh ``run_dir``
with a Ray cluster of its own, for one step (GRPO: ``examples/configs/grpo_math_tiny.yaml``,
no validation before the first step, with the defaults on CPUs: the policy's worker in the
driver's process, the hf engine inside it and the math environment in the driver;
``grpo-processes``: the same with the policy, the engine and the environment in processes of
their own, ``policy.in_driver=false generation.in_policy_workers=false
environments.math.in_driver=false``; SFT: ``examples/configs/sft.yaml``, no validation).
The parts, from the run's ``events.jsonl`` and ``metrics.jsonl``:

- ``before_ray``: the command's start to Ray's start: the interpreter, imports, the plugins,
  the config and its checks, the data (read, tokenized, checked);
- ``ray``: Ray's start (the ``Ray started`` event);
- ``workers``: the policy, generation and environment workers and the data plane, started at
  once (the ``workers started`` event, with each part's seconds);
- ``first_step``: from the workers being up to the first training step's record;
- ``total``: the command's start to the first step's record.

The machine's 1-minute load average before each run is printed with it: start-up is CPU
bound, so a loaded machine gives longer times. Medians over the repetitions, per algorithm.
``--record NAME`` writes the runs into the results file ``benchmarks/results/NAME.json``, one
run per algorithm (see ``record.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import record  # noqa: E402

GRPO_ONE_STEP = ("grpo.max_num_steps=1", "grpo.val_at_start=false")
#: Each run: its algorithm, example config and the overrides making it one step long.
RUNS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "grpo": ("grpo", "examples/configs/grpo_math_tiny.yaml", GRPO_ONE_STEP),
    "grpo-processes": ("grpo", "examples/configs/grpo_math_tiny.yaml",
                       (*GRPO_ONE_STEP, "policy.in_driver=false", "generation.in_policy_workers=false",
                        "environments.math.in_driver=false")),
    "sft": ("sft", "examples/configs/sft.yaml", ("sft.max_num_steps=1", "data.validation=null", "sft.val_at_end=false",
                                                 "sft.export_dir=null")),
}
PARTS = ("before_ray", "ray", "workers", "first_step", "total")


def run_once(name: str, model: str, run_dir: Path) -> dict[str, Any]:
    """One ``posttrain run`` of the run ``name``; its parts in seconds and the load before it."""
    algorithm, config, overrides = RUNS[name]
    command = [sys.executable, "-m", "posttrain.cli", "run", algorithm, "--config", config, f"policy.model={model}",
               f"run_dir={run_dir}", "logger.progress_bar=false", *overrides]
    load = os.getloadavg()[0]
    began = time.time()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{algorithm} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    events = {e["event"]: e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())}
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    ray, workers = events["Ray started"], events["workers started"]
    ray_ready, workers_ready = _timestamp(ray), _timestamp(workers)
    parts = {
        "before_ray": ray_ready - ray["seconds"] - began,
        "ray": ray["seconds"],
        "workers": workers["seconds"],
        "first_step": first["time"] - workers_ready,
        "total": first["time"] - began,
    }
    each = {k: v for k, v in workers.items() if k not in ("event", "level", "timestamp", "seconds")}
    return {"algorithm": name, "load": load, **parts, "worker_parts": each}


def _timestamp(event: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def report(results: list[dict[str, Any]]) -> str:
    lines = [f"{'run':<12}{'load':>6}" + "".join(f"{part:>12}" for part in PARTS) + "   workers by part"]
    for r in results:
        parts = " ".join(f"{name}={seconds:.2f}" for name, seconds in r["worker_parts"].items())
        lines.append(f"{r['algorithm']:<12}{r['load']:>6.2f}" + "".join(f"{r[part]:>12.2f}" for part in PARTS) + f"   {parts}")
    for algorithm in dict.fromkeys(r["algorithm"] for r in results):
        mine = [r for r in results if r["algorithm"] == algorithm]
        medians = "".join(f"{statistics.median(r[part] for r in mine):>12.2f}" for part in PARTS)
        lines.append(f"{algorithm + ' med':<12}{statistics.median(r['load'] for r in mine):>6.2f}{medians}")
    return "\n".join(lines)


def startup_record(results: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """A results file of these runs: one run per algorithm, a row per repetition."""
    runs = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in results):
        mine = [r for r in results if r["algorithm"] == algorithm]
        rows = [{"repeat": k + 1, **{f"{part}_s": round(r[part], 2) for part in PARTS},
                 "workers_by_part": ", ".join(f"{name} {seconds:.2f}" for name, seconds in r["worker_parts"].items())}
                for k, r in enumerate(mine)]
        loads = [r["load"] for r in mine]
        runs.append({"label": algorithm, "command": command, "date": record.today(),
                     "details": f"load before the runs {min(loads):.1f} to {max(loads):.1f}",
                     "source": "written by the benchmark (--record)", "rows": rows})
    return {"title": "Start-up", "conditions": "the tiny model, one training step, a fresh Ray cluster per run",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "run_header": "run", "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithms", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", type=Path, help="write every run's parts here as JSON")
    parser.add_argument("--record", metavar="NAME", help="also write them into benchmarks/results/NAME.json")
    args = parser.parse_args()
    from posttrain.models.tiny import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="startup-") as scratch:
        model = str(Path(scratch) / "tiny")
        build_tiny_model(model)
        print(f"{os.cpu_count()} CPUs; seconds from `posttrain run` to the first step", flush=True)
        for repeat in range(args.repeats):
            for algorithm in args.algorithms:
                results.append(run_once(algorithm, model, Path(scratch) / f"{algorithm}-{repeat}"))
                print(report(results[-1:]).splitlines()[1], flush=True)
    print(report(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    if args.record:
        print(f"recorded in {record.save(args.record, startup_record(results, record.command_line()))}")


if __name__ == "__main__":
    main()
