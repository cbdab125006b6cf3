"""posttrain-env-judge: the ``judge`` environment, an LLM that scores each response."""
