"""Hook implementations of posttrain-launch: the ``posttrain launch`` command."""

from __future__ import annotations

import argparse

from posttrain import hookimpl
from posttrain.interfaces import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from posttrain_launch.command import add_arguments

    add_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    return args.launch(args)


@hookimpl
def posttrain_commands():
    return {
        "launch": Command(
            help="start a Ray cluster on Slurm or Kubernetes and run on it", add_arguments=_add_arguments, run=_run
        )
    }
