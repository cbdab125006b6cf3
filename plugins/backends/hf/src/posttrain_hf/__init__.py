"""posttrain generation backend 'hf': transformers generate, for machines without vLLM."""
