"""Hook implementations of posttrain-eval: the ``eval`` algorithm, its config section and the
``posttrain eval`` command.

Every Ray worker loads this module, so it imports nothing heavy: the algorithm (torch) is
imported by its factory when a run builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from posttrain import hookimpl
from posttrain.config import require_registered
from posttrain.errors import ConfigError
from posttrain.interfaces import Command
from posttrain.plugins import plugin_host
from posttrain_eval.config import EvalConfig, check_eval_config

if TYPE_CHECKING:
    from posttrain_eval.algorithm import Eval


def eval_algorithm() -> Eval:
    """Factory of the ``eval`` algorithm."""
    from posttrain_eval.algorithm import Eval

    return Eval()


def _add_arguments(parser: Any) -> None:
    from posttrain_eval.command import add_arguments

    add_arguments(parser)


def _run(args: Any) -> int:
    from posttrain_eval.command import run

    return run(args)


@hookimpl
def posttrain_algorithms() -> Mapping[str, Any]:
    return {"eval": eval_algorithm}


@hookimpl
def posttrain_config_sections() -> Mapping[str, type]:
    return {"eval": EvalConfig}


@hookimpl
def posttrain_commands() -> Mapping[str, Command]:
    return {
        "eval": Command(
            help="pass@k, maj@k and mean reward of a model folder or checkpoint on a JSONL prompt set",
            add_arguments=_add_arguments,
            run=_run,
        )
    }


@hookimpl
def posttrain_validate_config(config: Any) -> None:
    if config.algorithm != "eval":
        return
    problems = check_eval_config(config.section("eval"), config)
    if problems:
        raise ConfigError(" ".join(problems))
    require_registered(plugin_host().generation_backends, config.generation.backend, "generation.backend", config=config)
    if config.section("eval").checkpoint:
        require_registered(plugin_host().policy_backends, config.policy.backend, "policy.backend", config=config)
