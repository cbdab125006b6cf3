"""posttrain-policy-torch: an example third-party policy backend for posttrain."""
