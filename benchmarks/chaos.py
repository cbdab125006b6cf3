"""Chaos: kill a process of a GRPO run at a random moment, again and again; every kill must end
in a clean stop or a transparent restart, and the finished run must log the metrics of a run
never interrupted.

    python benchmarks/chaos.py [--kills 20] [--seed 0] [--steps N] [--out runs/chaos]
                               [--asynchronous] [--data-plane memory|transferqueue] [--nodes 1|2]

The run is ``posttrain run grpo`` on ``examples/configs/grpo_math_tiny.yaml`` with the tiny
model (built here, nothing downloaded), a checkpoint every step, a validation pass every
:data:`VAL_PERIOD` steps and
``checkpointing.max_restarts`` as large as the number of kills; ``--asynchronous`` makes it
asynchronous GRPO (``max_staleness_steps: 1``, the engine on a CPU of its own) and
``--data-plane transferqueue`` keeps its samples in TransferQueue, and ``--nodes 2`` runs it on
a Ray cluster of two nodes on this machine (``ray start``, 3 CPUs each; the run joins it with
``RAY_ADDRESS``, one policy rank on each node). First an uninterrupted run
gives the reference metrics. Then, for each kill, the harness waits until the run has logged
1 to 3 more steps (drawn at random), waits a random fraction of a second more (the moment
falls in a rollout, a refit, a training pass or a checkpoint write) or, for one kill in four
(:data:`DURING_VALIDATION`), until the next validation pass begins, and kills a process drawn
at random:

- ``policy``: the policy worker (SIGKILL): the run must restart by itself;
- ``verifier``: a process of the math verifier's pool (SIGKILL): the run must go on, its step
  unchanged;
- ``driver-term``: the ``posttrain run`` process (SIGTERM): it must save, exit 143 within 30 s
  and resume when the command is run again;
- ``driver-kill``: the ``posttrain run`` process (SIGKILL): the command run again must resume
  from the last complete checkpoint;
- ``driver-save``: the ``posttrain run`` process (SIGKILL) while it writes a checkpoint (the
  moment its ``tmp_step_N`` folder appears): the same;
- ``engine`` (with ``--asynchronous``: a synchronous run's engine is inside the policy worker):
  the generation engine's worker (SIGKILL): the run must restart by itself;
- ``tq-controller``, ``tq-storage`` (with ``--data-plane transferqueue``): TransferQueue's
  controller or storage unit (SIGKILL): the run must restart by itself;
- ``raylet``: the Ray node's raylet (SIGKILL): the run may go on (its workers talk to each other
  directly), restart, or stop within 30 s naming the failure and resume;
- ``node`` (with ``--nodes 2``, instead of ``raylet``): every process of the node without the
  driver (SIGKILL, as a machine that lost power), and a new node started in its place: the run
  must restart by itself once the new node has joined.

After every exit the harness checks that no Ray process of the run is left alive (on two nodes:
no actor of the run), then runs the command again. It prints one row per kill (what, at which step, what happened, seconds to exit
or restart) and whether the finished run's training and validation metrics equal the
reference's, times and the counts of samples sent to an environment again
(``env/<name>/retried``) aside (``--out`` keeps the runs and a ``chaos.json`` of the rows). An
asynchronous run that restarts generates its rounds again from the restored weights, so its
numbers may differ; it must still log every step and every validation once and train every
step's prompts, the uninterrupted run's, once: the harness compares the trained groups and
prompts of each step (``async/groups_trained``, ``mean_prompt_length``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import psutil

from posttrain.testing.ray_nodes import LocalCluster

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/configs/grpo_math_tiny.yaml"
TARGETS = ("policy", "verifier", "driver-term", "driver-kill", "driver-save", "engine", "raylet")
#: What ``--nodes 2`` kills instead of the raylet: every process of the node without the driver.
NODE_TARGET = "node"
#: CPUs of each node with ``--nodes 2``: a policy rank (2 CPUs) on each, the engine beside rank 0.
NODE_CPUS = 3
#: Targets added with ``--data-plane transferqueue``.
QUEUE_TARGETS = ("tq-controller", "tq-storage")
#: What a target's process has in its command line (Ray names an actor's process after its class).
PATTERNS = {"policy": "DTensorPolicyWorker", "verifier": "posttrain.deadline_pool", "raylet": "raylet/raylet",
            "engine": "EngineWorker", "tq-controller": "ray::TransferQueueController",
            "tq-storage": "ray::SimpleStorageUnit"}
#: Targets without which no step can finish: a run that "went on" after their kill did not lose them.
MUST_NOT_GO_ON = ("policy", "engine", "tq-controller", "tq-storage", NODE_TARGET)
#: What an asynchronous run must train as the uninterrupted one did, step by step.
ASYNC_TRAINED = ("async/groups_trained", "mean_prompt_length", "num_valid_samples")
#: Metrics that measure time, not what was computed.
TIMED = ("timing/", "throughput/", "refit/seconds", "step_time_s", "time")
#: Metrics that count what a fault cost (samples sent to an environment again), not what was trained.
FAULT_COUNTS = ("/retried",)
EXIT_LIMIT_S = 30.0
#: Steps between validation passes (the 20 prompts of the example's validation file, greedy), so
#: that a kill may fall in one.
VAL_PERIOD = 5
#: The share of planned kills timed into a validation pass (a pass is short: a kill a random
#: fraction of a second after a step seldom falls in one).
DURING_VALIDATION = 0.25
#: Seconds a run's Ray processes may outlive its exit before they count as left behind: after a
#: driver killed with SIGKILL, Ray's node agents notice the raylet's death at once but wait on the
#: dead GCS before they exit, about 60 s on this machine.
LEFT_BEHIND_S = 90.0
#: What the command lines of a run's Ray processes hold: its daemons and its workers.
RAY_PROCESSES = ("raylet", "gcs_server", "log_monitor.py", "dashboard/agent.py", "runtime_env/agent", "ray::",
                 "default_worker.py")


@attrs.frozen
class Kill:
    """One kill: what, once the run has logged ``gap`` more steps (since the previous kill's
    outcome, or since the run's process started), and how long after that step (seconds); or,
    ``during="validation"``, as soon as the next validation pass has begun."""

    target: str
    gap: int
    delay_s: float
    during: str = "step"  # step | validation


@attrs.define
class Outcome:
    kill: Kill
    step: int = 0  # the steps the run had logged when the kill came
    validating: bool = False  # whether the kill came during a validation pass (after ``step``)
    result: str = ""  # restarted | went on | exited N | missed (the target was not running)
    seconds: float | None = None  # to the exit or the restart event
    message: str = ""  # the exit's error or stopped line
    victim: str = ""  # the process killed: pid, start time and command line
    left_behind: list[str] = attrs.field(factory=list)  # Ray processes alive LEFT_BEHIND_S after the exit
    ray_processes: list[psutil.Process] = attrs.field(factory=list, repr=False)  # the run's, when it exited
    exited_at: float | None = attrs.field(default=None, repr=False)  # time.monotonic()


@attrs.frozen
class Setup:
    """The run under test: synchronous or asynchronous GRPO, its data plane, and on how many
    Ray nodes (1: a cluster the run starts itself; 2: a cluster of this machine's nodes)."""

    asynchronous: bool = False
    data_plane: str = "memory"
    nodes: int = 1

    def overrides(self) -> list[str]:
        words = [f"data_plane.backend={self.data_plane}"]
        if self.nodes > 1:
            words += [f"cluster.num_nodes={self.nodes}", f"policy.num_workers={self.nodes}", "policy.resources.cpus=2",
                      "cluster.node_wait_s=120"]
        if self.asynchronous:
            words += ["grpo.asynchronous.max_staleness_steps=1", "generation.colocated=false",
                      # the tiny example's learning rate moves the policy so far between two weight versions that,
                      # past step 90, the gap over one-step-old samples passes the guard's stop bound (uninterrupted
                      # too); what is tested here is recovery
                      "grpo.mismatch_guard.stop_token_mult_prob_error=null", "grpo.mismatch_guard.stop_mismatch_kl=null"]
        return words

    def targets(self) -> tuple[str, ...]:
        """What a kill may hit: the generation engine only when asynchronous (a synchronous run's
        hf engine lives inside the policy worker by default), TransferQueue's actors with it, a
        node instead of the raylet on two nodes."""
        ours = TARGETS if self.asynchronous else tuple(t for t in TARGETS if t != "engine")
        if self.nodes > 1:
            ours = tuple(t for t in ours if t != "raylet") + (NODE_TARGET,)
        return ours + (QUEUE_TARGETS if self.data_plane == "transferqueue" else ())


def command(model: Path, run_dir: Path, steps: int, restarts: int, setup: Setup = Setup()) -> list[str]:
    return [
        sys.executable, "-m", "posttrain.cli", "run", "grpo", "--config", CONFIG, f"policy.model={model}",
        f"run_dir={run_dir}", f"grpo.max_num_steps={steps}", "grpo.max_num_epochs=1000", "grpo.val_at_start=false",
        f"grpo.val_period={VAL_PERIOD}",
        "checkpointing.save_period=1", "checkpointing.keep_top_k=2", f"checkpointing.max_restarts={restarts}",
        "checkpointing.restart_backoff_s=0.5", "logger.progress_bar=false",
        "policy.in_driver=false",  # a policy worker process of its own, to kill
        *setup.overrides(),
    ]


def start(words: list[str], log: Path, cluster: LocalCluster | None = None) -> subprocess.Popen:
    """The command in a Ray cluster of its own (or on ``cluster``), its output appended to ``log``."""
    address = cluster.address if cluster else ""
    env = {**os.environ, "RAY_ADDRESS": address, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    with log.open("a") as out:
        return subprocess.Popen(words, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def metric_records(run_dir: Path, phase: str = "train") -> list[dict[str, Any]]:
    """The run's metrics records of ``phase`` (``train`` or ``validation``), in order."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("phase") == phase]


def trained(record: dict[str, Any]) -> dict[str, Any]:
    """A step's record without its times and fault counts: what the step computed."""
    return {k: v for k, v in record.items() if not k.startswith(TIMED) and not k.endswith(FAULT_COUNTS)}


def events(run_dir: Path, name: str) -> int:
    """How many ``name`` events the run has logged."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return 0
    found = 0
    for line in path.read_text().splitlines():
        try:
            found += json.loads(line).get("event") == name
        except ValueError:  # a line being written
            pass
    return found


#: Every process seen under each run's command (by the command's pid): a raylet killed leaves
#: its workers running, adopted by init, and they are still the run's.
_SEEN: dict[int, set[psutil.Process]] = {}


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    """The run's processes alive now: those under its command, and those seen under it before
    (orphaned since). Never another run's, which may share this machine."""
    seen = _SEEN.setdefault(proc.pid, set())
    try:
        seen.update(psutil.Process(proc.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    return [p for p in seen if p.is_running()]


#: Processes of a node that Ray names like actors but that are the cluster's: an idle worker of
#: its pool and the node's agents.
NODE_DAEMONS = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def actors(cluster: LocalCluster | None) -> list[psutil.Process]:
    """The actor processes on ``cluster``'s nodes now (Ray names them ``ray::<class>``)."""
    found = []
    for node in cluster.nodes if cluster else ():
        for process in node.processes():
            try:
                words = process.cmdline()
            except psutil.Error:
                continue
            if words and words[0].startswith("ray::") and words[0].split()[0] not in NODE_DAEMONS:
                found.append(process)
    return found


def find(proc: subprocess.Popen, target: str, cluster: LocalCluster | None = None) -> psutil.Process | None:
    """The process ``target`` names among the run's (None when there is none now)."""
    if target.startswith("driver"):
        return psutil.Process(proc.pid)
    for candidate in descendants(proc) + actors(cluster):
        try:
            if PATTERNS[target] in " ".join(candidate.cmdline()):
                return candidate
        except psutil.Error:  # exited, or a zombie (a killed raylet until its parent reaps it)
            pass
    return None


def ray_processes(proc: subprocess.Popen, cluster: LocalCluster | None = None) -> list[psutil.Process]:
    """The run's Ray processes now: its cluster's daemons and workers (on ``cluster``, the
    cluster's daemons are not the run's: its actors)."""
    found = []
    for process in descendants(proc):
        try:
            if any(name in " ".join(process.cmdline()) for name in RAY_PROCESSES):
                found.append(process)
        except psutil.Error:
            pass
    return found + actors(cluster)


def wait(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def last_line(log: Path, start: int) -> str:
    """The last ``error:`` or ``stopped:`` line written to ``log`` after byte ``start``."""
    with log.open(errors="replace") as f:
        f.seek(start)
        lines = [line.strip() for line in f if line.startswith(("error:", "stopped:"))]
    return lines[-1][:200] if lines else ""


def inflict(kill: Kill, proc: subprocess.Popen, run_dir: Path, log: Path, mark: int,
            cluster: LocalCluster | None = None) -> tuple[Outcome, bool]:
    """Carry out ``kill`` on the running ``proc`` (on ``cluster``, when it runs on one) once
    the run has logged ``kill.gap`` steps past ``mark``; the outcome, and whether ``proc``
    exited. A node killed is replaced by a new one before this returns."""
    outcome = Outcome(kill)
    # a kill in a validation pass waits for the pass after the step before: it begins as that step is logged
    step = mark + kill.gap - (kill.during == "validation")

    def reached() -> bool:
        descendants(proc)  # record the run's workers while their raylet lives
        return len(metric_records(run_dir)) >= step or proc.poll() is not None

    if not wait(reached, 600) or proc.poll() is not None:
        outcome.result = "missed (the run had ended)"
        return outcome, proc.poll() is not None
    if kill.target == "driver-save":
        if not saving(run_dir, proc):
            outcome.result = "missed (no checkpoint write seen)"
            return outcome, proc.poll() is not None
    elif kill.during == "validation":
        if not validation_began(run_dir, proc, after=step):
            outcome.result = "missed (no validation pass seen)"
            return outcome, proc.poll() is not None
    else:
        time.sleep(kill.delay_s)
    outcome.step = len(metric_records(run_dir))
    outcome.validating = validating(run_dir, outcome.step)
    restarts, ours, log_size = events(run_dir, "restarting"), ray_processes(proc, cluster), log.stat().st_size
    if kill.target == NODE_TARGET:
        lost = cluster.nodes[-1]
        outcome.victim = f"node {lost.node_id()[:12]}: {len(lost.processes())} processes"
        killed = time.monotonic()
        lost.kill()
        replacement = threading.Thread(target=cluster.add_node, args=(NODE_CPUS,))
        replacement.start()
    else:
        victim = find(proc, kill.target, cluster)
        if victim is None:
            outcome.result = "missed (no such process now)"
            return outcome, False
        try:
            outcome.victim = f"{victim.pid} started {time.strftime('%H:%M:%S', time.localtime(victim.create_time()))}: " \
                             f"{' '.join(victim.cmdline())[:80]}"
        except psutil.Error:
            pass
        killed = time.monotonic()
        try:
            victim.send_signal(signal.SIGTERM if kill.target == "driver-term" else signal.SIGKILL)
        except psutil.NoSuchProcess:
            outcome.result = "missed (it had exited)"
            return outcome, False
    logged = len(metric_records(run_dir))
    wait(lambda: proc.poll() is not None or events(run_dir, "restarting") > restarts
         or len(metric_records(run_dir)) >= logged + 2, 120)
    outcome.seconds = round(time.monotonic() - killed, 1)
    if kill.target == NODE_TARGET:
        replacement.join()
    if proc.poll() is not None:
        outcome.result, outcome.message = f"exited {proc.returncode}", last_line(log, log_size)
        outcome.ray_processes, outcome.exited_at = ours, time.monotonic()  # checked at the end: see run_chaos
        return outcome, True
    if events(run_dir, "restarting") > restarts:
        outcome.result = "restarted"
    else:
        outcome.result, outcome.seconds = "went on", None
    return outcome, False


def validating(run_dir: Path, step: int) -> bool:
    """Whether the run is in the validation pass after ``step`` (the step's training logged, a
    pass due, its record not yet written)."""
    done = {r["step"] for r in metric_records(run_dir, "validation")}
    return step > 0 and step % VAL_PERIOD == 0 and step not in done


def validation_began(run_dir: Path, proc: subprocess.Popen, after: int, timeout_s: float = 600.0) -> bool:
    """Wait until the run logs a training step past ``after`` after which a validation pass is
    due, and return as it does (the pass has begun; on the tiny model it lasts tens of
    milliseconds, so the metrics file's size is watched every millisecond); False when none
    came within ``timeout_s`` or the run ended."""
    path, size, deadline = run_dir / "metrics.jsonl", None, time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        now = path.stat().st_size if path.exists() else 0
        if now != size:
            size = now
            lines = path.read_text().splitlines() if now else []
            try:
                last = json.loads(lines[-1]) if lines else {}
            except ValueError:  # a line being written
                size = None
                continue
            if last.get("phase") == "train" and last["step"] > after and last["step"] % VAL_PERIOD == 0:
                return True
        time.sleep(0.001)
    return False


def saving(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    """Wait until the run is writing a checkpoint (a ``tmp_step_N`` folder exists); False when
    none appeared within ``timeout_s`` or the run ended."""
    folder, deadline = run_dir / "checkpoints", time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(entry.name.startswith("tmp_step_") for entry in os.scandir(folder)):
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.002)
    return False


def alive_after(processes: list[psutil.Process], grace_s: float = LEFT_BEHIND_S) -> list[str]:
    """Which of ``processes`` still run ``grace_s`` seconds from now (see :data:`LEFT_BEHIND_S`)."""

    def alive() -> list[str]:
        found = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(" ".join(p.cmdline())[:60].strip())
            except psutil.NoSuchProcess:
                pass
        return found

    wait(lambda: not alive(), grace_s)
    return alive()


def plan(kills: int, seed: int, setup: Setup = Setup()) -> list[Kill]:
    """``kills`` kills of random targets, each 1 to 3 steps after the previous one's outcome, a
    random fraction of a second into the step, or (one in :data:`DURING_VALIDATION`) in the next
    validation pass."""
    rng = random.Random(seed)
    targets = setup.targets()
    return [Kill(rng.choice(targets), rng.randint(1, 3), round(rng.uniform(0.0, 1.0), 2),
                 "validation" if rng.random() < DURING_VALIDATION else "step") for _ in range(kills)]


def compared(record: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """What of a step's record must equal the uninterrupted run's: everything it computed
    (:func:`trained`) when synchronous; what it trained on when asynchronous (module docstring)."""
    if setup.asynchronous:
        return {"step": record["step"], **{key: record.get(key) for key in ASYNC_TRAINED}}
    return trained(record)


def run_chaos(kills: list[Kill], steps: int, out: Path, model: Path, setup: Setup = Setup()) -> dict[str, Any]:
    """The reference run, then the killed one; the rows and whether the metrics matched."""
    out.mkdir(parents=True, exist_ok=True)
    cluster = None
    if setup.nodes > 1:  # its folder short: Ray's socket paths live under it
        cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="chaos", dir="/tmp")), cwd=out)
        cluster.start_head(NODE_CPUS)
        for _ in range(setup.nodes - 1):
            cluster.add_node(NODE_CPUS)
    try:
        return _run_chaos(kills, steps, out, model, setup, cluster)
    finally:
        if cluster:
            cluster.stop()


def _run_chaos(kills: list[Kill], steps: int, out: Path, model: Path, setup: Setup,
               cluster: LocalCluster | None) -> dict[str, Any]:
    reference_dir, chaos_dir = out / "reference", out / "chaos"
    reference = start(command(model, reference_dir, steps, 0, setup), out / "reference.log", cluster)
    if reference.wait(timeout=1800) != 0:
        raise SystemExit(f"the uninterrupted run failed: see {out / 'reference.log'}")
    words, log = command(model, chaos_dir, steps, len(kills), setup), out / "chaos.log"
    proc = start(words, log, cluster)
    outcomes = []
    for kill in kills:
        outcome, exited = inflict(kill, proc, chaos_dir, log, len(metric_records(chaos_dir)), cluster)
        outcomes.append(outcome)
        print(row(outcome), flush=True)
        if exited:  # the same command again
            proc = start(words, log, cluster)
    ours = ray_processes(proc, cluster)
    if proc.wait(timeout=1800) != 0:
        proc = start(words, log, cluster)  # the last kill may have ended it after its final step began
        ours = ray_processes(proc, cluster) if proc.poll() is None else ours
        proc.wait(timeout=1800)
    records = metric_records(chaos_dir)
    found = [compared(r, setup) for r in records]
    expected = [compared(r, setup) for r in metric_records(reference_dir)]
    validations, expected_validations = (metric_records(d, "validation") for d in (chaos_dir, reference_dir))
    # an asynchronous run restarted validates other weights than the uninterrupted one: its passes, not their numbers
    same_validations = [r["step"] for r in validations] == [r["step"] for r in expected_validations] and (
        setup.asynchronous or [trained(r) for r in validations] == [trained(r) for r in expected_validations])
    retried = sum(v for r in records for k, v in r.items() if k.endswith(FAULT_COUNTS))
    return {"steps": steps, "final_exit": proc.returncode,
            "matched": found == expected and same_validations, "steps_logged": [r["step"] for r in records],
            "validations_logged": [r["step"] for r in validations], "samples_retried": retried,
            "identical": [trained(r) for r in records + validations] ==
                         [trained(r) for r in metric_records(reference_dir) + expected_validations],
            "left_behind_at_end": alive_after(ours), "kills": left_behind(outcomes)}


def left_behind(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """The rows, with each exit's Ray processes still alive :data:`LEFT_BEHIND_S` after it.
    Checked once the run is over, not before the command runs again: Ray's agents can take a
    minute to exit after a driver killed with SIGKILL, and they hold nothing the next run needs."""
    for outcome in outcomes:
        if outcome.exited_at is not None:
            grace = max(0.0, outcome.exited_at + LEFT_BEHIND_S - time.monotonic())
            outcome.left_behind = alive_after(outcome.ray_processes, grace)
    return [attrs.asdict(o, filter=lambda a, _: a.repr) for o in outcomes]


def row(outcome: Outcome) -> str:
    kill = outcome.kill
    took = "" if outcome.seconds is None else f"{outcome.seconds:5.1f} s"
    when = f"at step {outcome.step:3d} +{kill.delay_s:4.2f} s" + (" (validating)" if outcome.validating else "")
    return f"{kill.target:13s} {when:30s} {outcome.result:33s} {took:8s} {outcome.message}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: 6 per kill, plus 4)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--asynchronous", action="store_true", help="asynchronous GRPO, max_staleness_steps 1")
    parser.add_argument("--data-plane", choices=("memory", "transferqueue"), default="memory")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: run on a Ray cluster of two nodes of this machine, a node as a target")
    args = parser.parse_args(argv)
    from posttrain.models.tiny import build_tiny_model

    out = (args.out or Path(tempfile.mkdtemp(prefix="chaos_"))).resolve()
    model = build_tiny_model(out / "tiny_model", size="tiny", seed=0)
    steps = args.steps or 6 * args.kills + 4
    setup = Setup(args.asynchronous, args.data_plane, args.nodes)
    result = run_chaos(plan(args.kills, args.seed, setup), steps, out, model, setup)
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    for kill in result["kills"]:
        if kill["left_behind"]:
            print(f"Ray processes alive {LEFT_BEHIND_S:g} s after the exit of the kill of {kill['kill']['target']} at step "
                  f"{kill['step']}: {kill['left_behind']}")
    if result["left_behind_at_end"]:
        print(f"Ray processes of the run alive after it ended: {result['left_behind_at_end']}")
    failed = [k for k in result["kills"] if k["left_behind"] or
              (k["result"].startswith("exited") and (k["seconds"] or 0) > EXIT_LIMIT_S) or
              (k["result"] == "went on" and k["kill"]["target"] in MUST_NOT_GO_ON)]
    for kill in failed:
        print(f"a problem: {kill['kill']['target']} at step {kill['step']}: {kill['result']}; killed {kill['victim']}")
    print(f"{len(result['kills'])} kills; final exit {result['final_exit']}; steps logged {result['steps_logged']}; "
          f"validations logged after steps {result['validations_logged']}; "
          f"samples sent to an environment again: {result['samples_retried']:g}; "
          + ("trained groups and prompts of every step" if setup.asynchronous else "metrics (times and retry counts aside)")
          + f" equal to the uninterrupted run's: {result['matched']} (every metric: {result['identical']}); "
          f"kills with a problem: {len(failed)}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["matched"] else 1)
