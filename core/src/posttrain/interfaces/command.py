"""Commands: ``posttrain NAME ...`` subcommands that plugins register."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import attrs


@attrs.frozen
class Command:
    """A subcommand a plugin registers through ``posttrain_commands``: ``posttrain NAME ...``.

    ``add_arguments(parser)`` declares its arguments on its own ``argparse`` parser;
    ``run(args)`` runs it with the parsed arguments and returns the exit status. Raise
    :class:`~posttrain.errors.PosttrainError` for mistakes the user can fix (exit 2).
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
