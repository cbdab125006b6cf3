"""What an algorithm uses to run: the run context and ``run_algorithm``, the rollout loop,
environments in Ray actors, refit, checkpoints, metrics and graceful stops."""
