"""The ``posttrain`` command.

    posttrain run ALGORITHM --config FILE [key=value ...]
    posttrain config show ALGORITHM [--config FILE] [key=value ...]
                              the resolved config of that run, every key with its value,
                              its documentation and where it was set
    posttrain plugins         installed plugins and what they register (a broken one with
                              its error); every other command refuses to start while an
                              installed plugin cannot be loaded, naming its distribution
    posttrain NAME ...        a command registered by a plugin (posttrain_commands), e.g.
                              `posttrain quickstart` from posttrain-quickstart, `posttrain launch`
                              from posttrain-launch

Errors posttrain raises on purpose print as one ``error:`` paragraph and exit with status 2.
A run stopped by SIGINT / SIGTERM saves a checkpoint at the step boundary, prints one
``stopped:`` line and exits with 128 + the signal number (130, 143); a second signal stops
at once with 130. SIGTERM outside a run's steps (while it starts or shuts down) stops at once
with 143. ``posttrain run`` shuts down the Ray it started (not one this process was
already connected to), and starts a run whose worker died again from its checkpoint up to
``checkpointing.max_restarts`` times (:mod:`posttrain.run.restarts`).
Heavy modules (torch, ray) are imported only by the commands that need them.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from posttrain.errors import PluginError, PosttrainError, RunStopped
from posttrain.gc_thresholds import collect_less_often
from posttrain.interfaces.command import Command
from posttrain.run_command import add_run_arguments, load_checked_config, parse_arguments

#: Commands core defines itself; a plugin cannot register these names.
CORE_COMMANDS = ("run", "config", "plugins")


def _cmd_plugins(args: argparse.Namespace) -> int:
    """List every installed plugin, what it registers, the features its config sections
    declare (:mod:`posttrain.config.features`) and the packages they require, found or not
    (:mod:`posttrain.config.requirements`); one that could not be loaded is listed with its
    error (the command still succeeds)."""
    from posttrain.config.features import declared_features
    from posttrain.config.requirements import section_requirements
    from posttrain.plugins import plugin_host

    for info in plugin_host(allow_broken=True).plugins():
        print(f"{info.distribution} (plugin '{info.plugin_name}')")
        if info.error is not None:
            print(f"  error: {info.error}")
        elif not info.registrations:
            print("  (registers nothing)")
        kinds: dict[str, list[str]] = {}
        for reg in info.registrations:
            kinds.setdefault(reg.kind, []).append(reg.name)
        for kind, names in kinds.items():
            print(f"  {kind}: {', '.join(sorted(names))}")
        features = [text for reg in info.registrations if reg.kind == "config section"
                    for text in declared_features(reg.value)]
        if features:
            print(f"  features: {', '.join(features)}")
        for reg in info.registrations:
            for requirement in section_requirements(reg.value) if reg.kind == "config section" else ():
                problem = requirement.problem()
                status = "installed" if problem is None else f"{problem}: {requirement.install}"
                print(f"  requires: {requirement.module} ({status})")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from posttrain.config import load_config
    from posttrain.run.context import run_algorithm
    from posttrain.run.restarts import run_with_restarts

    config = load_config(args.config, [*args.overrides, f"algorithm={args.algorithm}"])
    run_with_restarts(config, run_algorithm)  # stops the Ray it started
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    from posttrain.config.reference import annotated_config

    config = load_checked_config(args.algorithm, args.config, args.overrides)
    sys.stdout.write(annotated_config(config))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Post-train language models: SFT, DPO, GRPO.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an algorithm from a YAML config")
    add_run_arguments(run)
    run.set_defaults(func=_cmd_run)

    config = sub.add_parser("config", help="inspect configs").add_subparsers(dest="config_command", required=True)
    show = config.add_parser(
        "show", help="the resolved config of a run: every key with its value, its documentation and where it was set"
    )
    show.add_argument("algorithm", help="algorithm name, e.g. grpo, sft, dpo (see `posttrain plugins`)")
    show.add_argument("--config", "-c", help="YAML config file (default: every key at its default)")
    show.add_argument("overrides", nargs="*", help="config overrides, e.g. policy.optimizer.lr=1e-5")
    show.set_defaults(func=_cmd_config_show)

    plugins = sub.add_parser("plugins", help="list installed plugins and what they register")
    plugins.set_defaults(func=_cmd_plugins)

    for name, command in _plugin_commands().items():
        plugin_parser = sub.add_parser(name, help=command.help)
        command.add_arguments(plugin_parser)
        plugin_parser.set_defaults(func=command.run)
    return parser


def _plugin_commands() -> dict[str, Command]:
    """The commands installed plugins register, checked; none when the plugins fail to load
    (``posttrain plugins`` then reports the failure)."""
    from posttrain.plugins import plugin_host

    try:
        registry = plugin_host(allow_broken=True).commands
        commands = {name: registry[name] for name in registry}
    except PluginError:
        return {}
    for name, command in commands.items():
        if name in CORE_COMMANDS:
            raise PluginError(f"{registry.distribution_of(name)} registers the command '{name}', which is core's own")
        if not isinstance(command, Command):
            raise PluginError(
                f"{registry.distribution_of(name)} registers the command '{name}' as a {type(command).__name__}; "
                "posttrain_commands() must map names to posttrain.interfaces.Command"
            )
    return commands


class _Terminated(KeyboardInterrupt):
    """SIGTERM outside a run's own stop handling (before its steps start or after they end)."""


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise _Terminated(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    collect_less_often()  # before the commands import torch and transformers
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = _parser()
        if argv and argv[0] != "plugins" and not argv[0].startswith("-"):
            from posttrain.plugins import plugin_host

            plugin_host()  # every other command needs every installed plugin: refuse a broken one
    except PosttrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parse_arguments(parser, argv)
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        return args.func(args)
    except RunStopped as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        return stop.exit_code
    except PosttrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except _Terminated:
        print("terminated by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m posttrain.cli: run the importable module, whose Command plugins use
    from posttrain.cli import main as _main

    sys.exit(_main())
