"""``posttrain launch``: the command line of the launchers.

    posttrain launch slurm --nodes N [options] [--dry-run] -- posttrain run ALGORITHM --config FILE ...
                              check the run's config here, write the sbatch script and
                              submit it with sbatch (--dry-run: print the script instead;
                              --no-check: skip the check)
    posttrain launch kuberay --nodes N --image IMAGE --cpus-per-node C --memory-per-node M [options]
                              -- posttrain run ...
                              print a KubeRay RayJob manifest (apply it with kubectl)
    posttrain launch wait (--nodes NAME ... | --num-nodes N) [--address HOST:PORT] [--timeout-s S]
                              wait until those nodes joined the Ray cluster; exit 2 naming
                              the missing ones past the timeout

The run command follows ``--``; ``cluster.num_nodes=N`` is added to its overrides.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from posttrain.errors import ClusterError, ConfigError, PosttrainError
from posttrain.run_command import check_run_config
from posttrain_launch.kuberay import RayJobSpec, rayjob_manifest
from posttrain_launch.slurm import SlurmJob, sbatch_script


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``posttrain launch``'s subcommands on ``parser``."""
    sub = parser.add_subparsers(dest="launcher", required=True)

    slurm = sub.add_parser("slurm", help="a Ray cluster on a Slurm job's nodes, then the run on its head")
    _common(slurm)
    slurm.add_argument("--job-name", default="posttrain", help="Slurm job name (default: posttrain)")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (Slurm --gpus-per-node)")
    slurm.add_argument("--cpus-per-node", type=int, help="CPUs of each node's Ray (default: what Slurm gives)")
    slurm.add_argument("--partition", help="Slurm partition")
    slurm.add_argument("--account", help="Slurm account")
    slurm.add_argument("--time", dest="time_limit", help="Slurm time limit, e.g. 04:00:00")
    slurm.add_argument("--output", default="posttrain-%j.out", help="the job's log file (default: posttrain-%%j.out)")
    slurm.add_argument("--setup", action="append", default=[], metavar="LINE",
                       help="a shell line run first, e.g. 'source /shared/venv/bin/activate' (repeatable)")
    slurm.add_argument("--port", type=int, default=6379, help="the Ray head's port (default: 6379)")
    slurm.add_argument("--node-wait-s", type=float, default=600.0,
                       help="seconds to wait for every node to join (default: 600)")
    slurm.add_argument("--script", type=Path, help="where to write the script (default: ./JOB_NAME.sbatch)")
    slurm.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    slurm.add_argument("--no-check", action="store_true",
                       help="do not load the run's config here first (e.g. when a --setup line changes directory)")
    slurm.set_defaults(launch=_cmd_slurm)

    kuberay = sub.add_parser("kuberay", help="print a KubeRay RayJob manifest that runs the command")
    _common(kuberay)
    kuberay.add_argument("--name", default="posttrain", help="the RayJob's name (default: posttrain)")
    kuberay.add_argument("--image", required=True, help="container image with posttrain and its plugins installed")
    kuberay.add_argument("--cpus-per-node", type=int, required=True, help="CPUs of each pod")
    kuberay.add_argument("--memory-per-node", required=True, help="memory of each pod, e.g. 64Gi")
    kuberay.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu of each pod")
    kuberay.add_argument("--volume-claim", default="posttrain-shared",
                         help="PersistentVolumeClaim (ReadWriteMany) every pod mounts (default: posttrain-shared)")
    kuberay.add_argument("--mount-path", default="/shared", help="where pods mount it (default: /shared)")
    kuberay.add_argument("--workdir", default="/shared", help="where the run starts (default: /shared)")
    kuberay.set_defaults(launch=_cmd_kuberay)

    wait = sub.add_parser("wait", help="wait until the Ray cluster's nodes have joined")
    wait.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                      help="the head's HOST:PORT (default: $RAY_ADDRESS)")
    which = wait.add_mutually_exclusive_group(required=True)
    which.add_argument("--nodes", nargs="+", default=[], metavar="NAME", help="host names (or addresses) to wait for")
    which.add_argument("--num-nodes", type=int, default=0, help="how many nodes to wait for")
    wait.add_argument("--timeout-s", type=float, default=600.0, help="seconds to wait in all (default: 600)")
    wait.set_defaults(launch=_cmd_wait)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the Ray cluster")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of every node (repeatable)")
    parser.add_argument("run_words", nargs=argparse.REMAINDER, metavar="-- posttrain run ...",
                        help="the run: -- posttrain run ALGORITHM --config FILE [key=value ...]")


def run_command(words: list[str], nodes: int) -> tuple[str, ...]:
    """The ``posttrain run`` command after ``--``, with ``cluster.num_nodes=nodes`` added."""
    words = words[1:] if words[:1] == ["--"] else words
    if words[:2] != ["posttrain", "run"] or len(words) < 3:
        found = shlex.join(words) if words else "nothing"
        raise ConfigError(
            "posttrain launch: give the run after --, e.g. `-- posttrain run grpo --config exp.yaml`; "
            f"found {found}"
        )
    if nodes < 1:
        raise ConfigError(f"posttrain launch: --nodes must be at least 1, found {nodes}")
    return (*words, f"cluster.num_nodes={nodes}")


def env_pairs(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=VALUE`` words as pairs; a word without ``=`` is refused."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ConfigError(f"posttrain launch: --env {item!r} is not NAME=VALUE")
        pairs.append((name, value))
    return tuple(pairs)


def check_in_launch_directory(command: tuple[str, ...]) -> None:
    """Load the run's config in this directory, where the Slurm job starts, so that a mistake
    in it fails now rather than once the job left the queue (:func:`posttrain.run_command.check_run_config`)."""
    try:
        check_run_config(command[2:])
    except PosttrainError as error:
        raise ConfigError(
            f"posttrain launch slurm: nothing was written or submitted: the run's config, loaded here "
            f"({Path.cwd()}) as the job will load it, is refused (--no-check skips this check): {error}"
        ) from None


def _cmd_slurm(args: argparse.Namespace) -> int:
    command = run_command(args.run_words, args.nodes)
    if not args.no_check:
        check_in_launch_directory(command)
    job = SlurmJob(
        nodes=args.nodes, command=command, job_name=args.job_name,
        gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node, partition=args.partition,
        account=args.account, time_limit=args.time_limit, output=args.output, setup=tuple(args.setup),
        env=env_pairs(args.env), port=args.port, node_wait_s=args.node_wait_s,
    )
    script = sbatch_script(job)
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ClusterError(
            "posttrain launch slurm: sbatch is not on PATH; run this on a Slurm login node, or use --dry-run to "
            "print the script"
        )
    path = args.script or Path(f"{args.job_name}.sbatch")
    path.write_text(script)
    print(f"wrote {path}")
    return subprocess.run([sbatch, str(path)], check=False).returncode


def _cmd_kuberay(args: argparse.Namespace) -> int:
    import ray

    command = run_command(args.run_words, args.nodes)
    spec = RayJobSpec(
        name=args.name, nodes=args.nodes, image=args.image, command=command, cpus_per_node=args.cpus_per_node,
        memory_per_node=args.memory_per_node, gpus_per_node=args.gpus_per_node, volume_claim=args.volume_claim,
        mount_path=args.mount_path, workdir=args.workdir, env=env_pairs(args.env), ray_version=ray.__version__,
    )
    header = "# A KubeRay RayJob written by `posttrain launch kuberay`; apply it with `kubectl apply -f FILE`.\n"
    sys.stdout.write(rayjob_manifest(spec, header=header))
    return 0


def _cmd_wait(args: argparse.Namespace) -> int:
    from posttrain_launch.wait import wait_for_cluster

    if not args.address:
        raise ClusterError("posttrain launch wait: give --address HOST:PORT or set RAY_ADDRESS")
    labels = wait_for_cluster(args.address, names=args.nodes, count=args.num_nodes, timeout_s=args.timeout_s)
    print(f"{len(labels)} Ray node(s) alive: {'; '.join(labels)}")
    return 0
