"""posttrain environments: math answers verified with math-verify, and a multi-turn puzzle."""
