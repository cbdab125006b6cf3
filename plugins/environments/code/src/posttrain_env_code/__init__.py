"""posttrain environment 'code': model-written Python checked against tests in a sandboxed process."""
