"""posttrain algorithm 'grpo': group relative policy optimisation and its relatives."""
