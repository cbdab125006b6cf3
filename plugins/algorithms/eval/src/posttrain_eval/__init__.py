"""posttrain command and algorithm 'eval': pass@k, maj@k and mean reward of a model or checkpoint."""
