"""posttrain generation backend 'vllm': vLLM engines in Ray actors with weight refit."""
