"""posttrain policy backend 'megatron': megatron-core GPTModel with tensor, pipeline and context parallelism."""
