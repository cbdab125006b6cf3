"""posttrain algorithm 'ppo': PPO with a value model (critic), GAE and value clipping."""
