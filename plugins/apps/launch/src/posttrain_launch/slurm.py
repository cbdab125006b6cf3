"""The sbatch script that starts a Ray cluster on a Slurm job's nodes and a run on its head.

The script (:func:`sbatch_script`) runs on the job's first node, as Slurm runs batch
scripts. It

1. runs the ``setup`` lines (e.g. activating the environment that has posttrain), whose
   environment ``srun`` passes on to every node;
2. starts the Ray head on the first node and a Ray worker on each other node, one ``srun``
   step each (``ray start --block``: they stop when the job ends);
3. waits until every node of the job has joined, for ``node_wait_s`` seconds at most
   (``posttrain launch wait``, which names the nodes that did not join);
4. runs the ``posttrain run`` command on the head node, where ``RAY_ADDRESS`` names the
   cluster; the job's exit status is the run's.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import attrs


@attrs.frozen
class SlurmJob:
    """What the sbatch script asks Slurm for and runs. ``command`` is the ``posttrain run``
    command, as words; ``env`` holds ``(name, value)`` pairs exported before Ray starts."""

    nodes: int
    command: tuple[str, ...]
    job_name: str = "posttrain"
    gpus_per_node: int = 0  # GPUs Slurm gives each node and Ray counts on it; 0: none asked
    cpus_per_node: int | None = None  # CPUs of each node's Ray; None: all of the first node's ($SLURM_CPUS_ON_NODE)
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None  # Slurm's --time, e.g. 04:00:00
    output: str = "posttrain-%j.out"  # Slurm's --output (%j: the job id)
    setup: tuple[str, ...] = ()  # shell lines run first, on the head; srun passes their environment on
    env: tuple[tuple[str, str], ...] = ()
    port: int = 6379  # the Ray head's port (its GCS)
    node_wait_s: float = 600.0  # seconds the script waits for every node to join


def sbatch_script(job: SlurmJob) -> str:
    """The text of the sbatch script for ``job`` (bash)."""
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        f"--output={job.output}",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_node is not None:
        directives.append(f"--cpus-per-task={job.cpus_per_node}")
    directives += [f"--{key}={value}" for key, value in
                   (("partition", job.partition), ("account", job.account), ("time", job.time_limit)) if value]
    ray_resources = ' --num-cpus="$CPUS_PER_NODE"' + (f" --num-gpus={job.gpus_per_node}" if job.gpus_per_node else "")
    step = 'srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_NODE"'
    lines = [
        "#!/bin/bash",
        "# Written by `posttrain launch slurm`: a Ray cluster on this job's nodes, then the run on its head.",
        *(f"#SBATCH {directive}" for directive in directives),
        "",
        "set -euo pipefail",
        "",
    ]
    if job.setup or job.env:
        lines += ["# The environment of every node (srun passes it on to the Ray processes)."]
        lines += [*job.setup, *(f"export {name}={shlex.quote(value)}" for name, value in job.env), ""]
    lines += [
        f"RAY_PORT={job.port}",
        f"NODE_WAIT_S={job.node_wait_s:g}",
        f"CPUS_PER_NODE={job.cpus_per_node if job.cpus_per_node is not None else '$SLURM_CPUS_ON_NODE'}",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'HEAD_NODE="${NODES[0]}"',
        "# This script runs on the first node: its address is the head's.",
        "HEAD_IP=$(hostname --ip-address | awk '{print $1}')",
        'export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"',
        "",
        "# The Ray head on the first node, a Ray worker on every other one; they stop when the job ends.",
        f'{step} --nodelist="$HEAD_NODE" \\',
        f'  ray start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT"{ray_resources} --block &',
        'for node in "${NODES[@]:1}"; do',
        f'  {step} --nodelist="$node" \\',
        f'    ray start --address="$RAY_ADDRESS"{ray_resources} --block &',
        "done",
        "",
        "# Every node joined within NODE_WAIT_S seconds, or the job ends naming those that did not.",
        'posttrain launch wait --address "$RAY_ADDRESS" --nodes "${NODES[@]}" --timeout-s "$NODE_WAIT_S"',
        "",
        "# The run, on the head node (RAY_ADDRESS names the cluster).",
        _command_lines(job.command),
        "",
    ]
    return "\n".join(lines)


def _command_lines(words: Sequence[str]) -> str:
    """``words`` as one shell command, each ``key=value`` override on a continued line."""
    parts: list[str] = []
    for word in words:
        if parts:
            parts.append(" \\\n  " if "=" in word and not word.startswith("-") else " ")
        parts.append(shlex.quote(word))
    return "".join(parts)
