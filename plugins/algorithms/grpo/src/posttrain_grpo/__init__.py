"""posttrain algorithm 'grpo': group relative policy optimisation and its relatives.

Modules: :mod:`.algorithm` (the training loop), :mod:`.step` (one step's arithmetic and
metrics), :mod:`.prompts` (the resumable prompt stream), :mod:`.config` (the
``grpo`` section), :mod:`.validation` (refused combinations), :mod:`.rewards` (scaling,
overlong shaping and filtering), :mod:`.advantages` (group baselines),
:mod:`.dynamic_sampling` (DAPO's filter and accumulator), :mod:`.loss` (``clipped_pg``).
"""
