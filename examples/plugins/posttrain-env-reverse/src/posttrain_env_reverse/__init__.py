"""posttrain-env-reverse: an example third-party environment plugin for posttrain."""
