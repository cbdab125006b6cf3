"""posttrain algorithm 'dpo': direct preference optimisation (sigmoid, IPO, reference-free)."""
