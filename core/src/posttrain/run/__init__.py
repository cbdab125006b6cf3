"""What an algorithm uses to run: the run context and ``run_algorithm`` (context), the outer
training loop (loop), the supervised algorithm (supervised, supervised_config), the rollout
loop, environments in Ray actors, refit, checkpoints and the training state they hold,
metrics and graceful stops."""
