"""The backend author's kit: what policy and generation backends share (the driver side of
a sharded policy, the generation worker group, chunked logprobs, Hugging Face export,
learning-rate schedules, sampling helpers)."""
