"""posttrain algorithm 'rm' (Bradley-Terry reward models) and environment 'reward_model'."""
