"""The deadline pool's worker processes: seconds to start and memory each, beside a bare
interpreter measured in the same run.

    python benchmarks/deadline_pool.py [--workers 2] [--repeats 5] [--job MODULE:FUNCTION]

A pool of ``--workers`` processes for the job function (default: the math environment's
scorer, whose module every math worker imports) is started ``--repeats`` times; each start is
timed from the constructor's call to every worker being ready, and each worker's resident
memory (``VmRSS``) is read once it is ready. Beside it, two interpreters started the same way:
one that imports the job's module and nothing else (what a worker cannot do with less), and
a bare one (``python -c`` with no import); each reports its own ``VmRSS`` before exiting.
Medians.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import time
from pathlib import Path


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def pool_start(job: str, workers: int) -> tuple[float, list[float]]:
    from posttrain.deadline_pool import DeadlinePool

    module, name = job.split(":")
    began = time.perf_counter()
    pool = DeadlinePool(getattr(importlib.import_module(module), name), num_workers=workers, timeout_s=60)
    seconds = time.perf_counter() - began
    try:
        return seconds, [rss_mib(w.process.pid) for w in pool._workers]
    finally:
        pool.close()


def interpreter_start(imports: str) -> tuple[float, float]:
    """Seconds to run ``python -c`` with ``imports`` and report its own memory; that memory in MiB."""
    report = "import re; print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", f"{imports}\n{report}"], check=True, capture_output=True, text=True)
    return time.perf_counter() - began, int(done.stdout) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--job", default="posttrain_env_math.scoring:score_response")
    args = parser.parse_args()
    pools = [pool_start(args.job, args.workers) for _ in range(args.repeats)]
    module = args.job.split(":")[0]
    alone = [interpreter_start(f"import {module}") for _ in range(args.repeats)]
    bare = [interpreter_start("") for _ in range(args.repeats)]
    rows = [
        (f"pool of {args.workers} workers for {args.job} (per worker)", statistics.median(s for s, _ in pools),
         statistics.median(m for _, mems in pools for m in mems)),
        (f"python -c 'import {module}'", statistics.median(s for s, _ in alone), statistics.median(m for _, m in alone)),
        ("python -c '' (bare)", statistics.median(s for s, _ in bare), statistics.median(m for _, m in bare)),
    ]
    print("| process | start (s) | resident memory (MiB) |\n|---|---:|---:|")
    for name, seconds, mib in rows:
        print(f"| {name} | {seconds:.3f} | {mib:.1f} |")
    print(f"pool start / the module alone: {rows[0][1] / rows[1][1]:.2f}x; "
          f"worker memory / the module alone: {rows[0][2] / rows[1][2]:.2f}x")


if __name__ == "__main__":
    main()
