"""posttrain algorithm 'distill': on-policy distillation from a teacher's top-k logits."""
