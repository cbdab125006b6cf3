"""The command line of ``posttrain run``: its arguments, how they are read, and the check a
launcher makes of a run's config before it sends the run elsewhere (:mod:`posttrain.cli`
and launchers, e.g. the posttrain-launch plugin, both read runs through this module)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posttrain.config import RunConfig


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``posttrain run``'s arguments on ``parser``."""
    parser.add_argument("algorithm", help="algorithm name, e.g. grpo, sft, dpo (see `posttrain plugins`)")
    parser.add_argument("--config", "-c", required=True, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. policy.optimizer.lr=1e-5")


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed by ``parser`` as the ``posttrain`` command line reads it: key=value
    words after an option are overrides too; anything else left over exits 2 with the usage."""
    args, extra = parser.parse_known_args(argv)
    # argparse leaves positionals that follow an option (`run sft --config f a=1`) unparsed:
    # take such key=value words as overrides, in order.
    if extra and hasattr(args, "overrides") and all("=" in word and not word.startswith("-") for word in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def check_run_config(words: Sequence[str]) -> None:
    """Load the config of ``posttrain run WORDS...`` (``words`` follow ``run``) in this
    directory, as the run will load it: its algorithm, keys, values and plugin options are
    checked (files and the cluster are checked when it runs). Raises what the run would."""
    parser = argparse.ArgumentParser(prog="posttrain run")
    add_run_arguments(parser)
    args = parse_arguments(parser, words)
    load_checked_config(args.algorithm, args.config, args.overrides)


def load_checked_config(algorithm: str, path: str | None, overrides: Sequence[str]) -> RunConfig:
    """The config of ``posttrain run ALGORITHM --config PATH OVERRIDES...`` (``path`` None:
    every key at its default), for a command that checks or shows it without running it: an
    algorithm no installed plugin registers is refused as the run refuses it."""
    from posttrain.config import load_config
    from posttrain.plugins import plugin_host

    plugin_host().algorithms[algorithm]
    return load_config(path, [*overrides, f"algorithm={algorithm}"])
