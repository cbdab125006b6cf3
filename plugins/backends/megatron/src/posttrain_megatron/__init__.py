"""posttrain policy backend 'megatron': megatron-core GPTModel with tensor, pipeline and context parallelism."""

from posttrain.log import quiet_library_warnings

# megatron-core warns, at import and when it builds a model, about optional parts a run cannot
# act on (Transformer Engine, Apex). A worker process hides those below debug before any module
# here imports it; the driver knows its level only once the run configured it (make_policy).
quiet_library_warnings("megatron")
