"""The options of the ``math`` and ``guess_number`` environments (the mappings under
``environments.math`` and ``environments.guess_number``), declared on their factories in
:mod:`posttrain_env_math.plugin` and read by core like a config section. Torch-free: the
plugin module imports this at entry-point load."""

from __future__ import annotations

import attrs

from posttrain.config.environments import above


@attrs.frozen
class MathOptions:
    """Options of the ``math`` environment (``environments.math``)."""

    # seconds to extract and verify one response (> 0); a slower one scores 0 and counts in verify_timeouts
    timeout_s: float = attrs.field(default=10.0, validator=above(0))
    num_workers: int = attrs.field(default=2, validator=above(0))  # verifier processes scoring responses in parallel


@attrs.frozen
class GuessNumberOptions:
    """Options of the ``guess_number`` environment (``environments.guess_number``)."""

    # guesses a game allows (> 0); the last one wrong ends it with reward 0 (grpo.max_rollout_turns: at least this)
    max_guesses: int = attrs.field(default=8, validator=above(0))
