"""The ``generation.hf`` config section: options of the transformers generation backend.

Everything shared by all backends (model, dtype, sampling, stop criteria, number of
engines, resources) is in the core ``generation`` section.
"""

from __future__ import annotations

import attrs

SECTION = "generation.hf"


@attrs.define
class HFGenerationConfig:
    """Options of the ``hf`` generation backend.

    - ``max_batch_size``: rows one engine decodes together; a larger shard is decoded in
      consecutive chunks (results do not depend on it: every row has its own seed).
    - ``attn_implementation``: the transformers attention kernel (``sdpa`` or ``eager``);
      ``sdpa`` on the CPU shares grouped-query heads instead of copying them
      (:mod:`posttrain_hf.attention`).

    Its engines can run inside the policy's worker processes (``generation.in_policy_workers``).
    """

    runs_in_policy_workers = True  # a feature (posttrain.config.features), not an option

    max_batch_size: int = 64
    attn_implementation: str = "sdpa"
