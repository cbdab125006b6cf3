"""The ``eval`` algorithm (``posttrain run eval``, and what ``posttrain eval`` runs): score a
model, or a run's checkpoint, on the prompts of ``data.validation``.

As data::

    data.validation (prompt rows; the first eval.max_prompts)
      -> x eval.num_samples completions each: generation.backend + the environments
         (eval.checkpoint: the checkpoint's policy weights loaded by policy.backend and sent
         to the engines first, as a refit)
      -> mean_reward, pass_at_<k>, maj_at_<k>, mean_response_length and the rollout metrics
      -> metrics.jsonl (phase validation, step: the checkpoint's step, else 0) and
         eval.samples_file (one record per completion)

Nothing is trained or checkpointed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.config import where_set
from posttrain.data import encoder_from_config, require_dataset
from posttrain.errors import ConfigError
from posttrain.interfaces import Algorithm, Generation
from posttrain.run.checkpoint import INFO_FILE, POLICY_DIR
from posttrain.run.context import RunContext
from posttrain.run.environments import environment_names, shutdown_environments
from posttrain.run.prompt_rollout import PromptRollout
from posttrain.run.refit import refit
from posttrain_eval.config import EvalConfig
from posttrain_eval.evaluate import evaluate


class Eval(Algorithm):
    """Evaluation of generated completions (options: the ``eval`` config section).

    ``environment_plugins`` are importable plugin modules that register environments not
    installed as distributions; they are registered in every environment actor.
    """

    name = "eval"
    config_section = "eval"

    def __init__(self, environment_plugins: Sequence[str] = ()):
        self.environment_plugins = tuple(environment_plugins)

    def run(self, context: RunContext) -> dict[str, Any]:
        config = context.config
        options: EvalConfig = config.section("eval")
        encoder = encoder_from_config(config)
        dataset = require_dataset(config, "validation", "prompt", encoder)
        plugins = self.environment_plugins
        names, default_task = environment_names(config, [dataset], plugins=plugins)
        count = len(dataset) if options.max_prompts is None else min(options.max_prompts, len(dataset))
        prompts = dataset.collate(range(count))
        step = checkpoint_step(options.checkpoint, config) if options.checkpoint else 0
        with contextlib.ExitStack() as cleanup:
            context.start_cluster(colocate=False)  # its engines share no policy's devices
            startup = context.startup(cleanup)
            environments = startup.start(
                "environments", lambda: context.build_environments(names, plugins=plugins), shutdown_environments
            )
            sized = config.generation.with_rows_per_call(count * options.num_samples)  # one call: every sample
            generation = startup.start("generation", lambda: context.build_generation(sized))
            startup.wait()
            if options.checkpoint:
                load_checkpoint_weights(context, generation.value, options.checkpoint, step)
            rollout = PromptRollout(
                generation.value, environments.value, encoder.tokenizer, config.policy.max_total_sequence_length,
                options.max_rollout_turns, encoder.template, default_task, encoder.images,
            )
            generation.value.set_sampling_seed(config.seed)
            generation.value.prepare_for_generation()
            try:
                result = evaluate(prompts, rollout, num_samples=options.num_samples, greedy=options.greedy,
                                  ks=options.k, correct_reward=options.correct_reward)
            finally:
                generation.value.finish_generation()
        metrics = {**result.metrics, **result.rollout_metrics, "num_prompts": float(count),
                   "num_samples": float(options.num_samples)}
        context.log_metrics(step, metrics, "validation")
        if options.samples_file is not None:
            path = context.run_dir / options.samples_file
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                for record in result.records(options.correct_reward):
                    f.write(json.dumps(record) + "\n")
        context.log.info("evaluated", prompts=count, samples=options.num_samples, step=step,
                         **{name: round(value, 4) for name, value in result.metrics.items()})
        return {"step": step, **metrics}


def checkpoint_step(folder: str, config: Any) -> int:
    """The training step of the checkpoint ``folder`` (``eval.checkpoint``), after checking
    that it is a complete checkpoint with a policy; a :class:`ConfigError` otherwise."""
    path = Path(folder)
    missing = [name for name in (INFO_FILE, POLICY_DIR) if not (path / name).exists()]
    if missing:
        raise ConfigError(
            f"eval.checkpoint: '{folder}' is not a complete checkpoint (it has no {', '.join(missing)}); point it at a "
            f"step_N folder of a run's checkpoints.{where_set(config, 'eval.checkpoint')}"
        )
    return int(json.loads((path / INFO_FILE).read_text())["step"])


def load_checkpoint_weights(context: RunContext, generation: Generation, folder: str, step: int) -> None:
    """Send the policy weights of checkpoint ``folder`` to ``generation``'s engines: the policy
    backend loads them (its workers exist only for this) and refits the engines, then stops."""
    policy = context.build_policy(schedule_steps=1, reference=False)
    try:
        policy.load_checkpoint(str(Path(folder) / POLICY_DIR))
        refit(policy, generation, context.config.generation.refit_bucket_bytes, version=step)
    finally:
        policy.shutdown()
