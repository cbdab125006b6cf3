"""Hook implementations of posttrain-quickstart: the ``posttrain quickstart`` command."""

from __future__ import annotations

import argparse

from posttrain import hookimpl
from posttrain.interfaces import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default="runs/quickstart", help="where outputs go (default: runs/quickstart)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights, data order and sampling (default: 0)")
    parser.add_argument("overrides", nargs="*", help="config overrides for both stages")


def _run(args: argparse.Namespace) -> int:
    from posttrain_quickstart.requirements import check_requirements

    check_requirements()  # before anything is built or trained
    from posttrain_quickstart.run import run_quickstart

    run_quickstart(args.run_dir, list(args.overrides), seed=args.seed)
    return 0


@hookimpl
def posttrain_commands():
    return {
        "quickstart": Command(
            help="SFT then GRPO on a tiny built-in model and task, on CPU", add_arguments=_add_arguments, run=_run
        )
    }
