"""The ``generation.hf`` config section: options of the transformers generation backend.

Everything shared by all backends (model, dtype, sampling, stop criteria, number of
engines, resources) is in the core ``generation`` section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig

SECTION = "generation.hf"


@attrs.define
class HFGenerationConfig:
    """Options of the ``hf`` generation backend.

    - ``max_batch_size``: rows one engine decodes together; a larger shard is decoded in
      consecutive chunks (results do not depend on it: every row has its own seed).
    - ``attn_implementation``: the transformers attention kernel (``sdpa`` or ``eager``);
      ``sdpa`` on the CPU shares grouped-query heads instead of copying them
      (:mod:`posttrain_hf.attention`).

    Its engines can run inside the policy's worker processes (``generation.in_policy_workers``),
    report the policy's logprobs bit for bit (``generation.exact_logprobs``, with
    ``attn_implementation: sdpa``; :mod:`posttrain_hf.exact`), and record the experts each token
    of a mixture of experts went through (``policy.moe``).
    """

    runs_in_policy_workers = True  # features (posttrain.config.features), not options
    supports_exact_logprobs = True
    records_routed_experts = True

    max_batch_size: int = 64
    attn_implementation: str = "sdpa"


def validate_generation_config(config: RunConfig) -> None:
    """An ``hf`` engine is one process on one device: ``generation.tensor_parallel_size`` 1;
    exact logprobs rescore with the ``sdpa`` kernel."""
    from posttrain.config.validate import where_set

    options: HFGenerationConfig = config.sections.get(SECTION) or HFGenerationConfig()
    if config.generation.exact_logprobs and options.attn_implementation != "sdpa":
        raise ConfigError(
            f"generation.exact_logprobs is true, but {SECTION}.attn_implementation is "
            f"'{options.attn_implementation}': the engines rescore their samples with the policy's sdpa arithmetic; "
            f"set {SECTION}.attn_implementation: sdpa.{where_set(config, 'generation.exact_logprobs', f'{SECTION}.attn_implementation')}"
        )
    size = config.generation.tensor_parallel_size
    if size != 1:
        raise ConfigError(
            f"generation.tensor_parallel_size is {size}, but an hf engine runs in one process on one device (no tensor "
            "parallelism); set generation.tensor_parallel_size: 1, or use generation.backend: vllm."
            f"{where_set(config, 'generation.tensor_parallel_size')}"
        )
