"""What ``generation.exact_logprobs`` needs of a run (checked when the config loads, by
:func:`posttrain.config.validate.check_exact_logprobs`) and what it gives.

Exact logprobs (:mod:`posttrain.backend.exact`) hold when the policy backend and the
generation backend both declare ``supports_exact_logprobs`` and the run keeps the arithmetic
of the two sides the same: one dtype, the sampler's unfiltered distribution (no top-k or
top-p: the trainer computes the full softmax), one device per policy replica (tensor
parallelism splits the products' sums), and CPUs (there the kernels give a row the same bits in
any batch; GPU libraries pick kernels by the shape of the whole product). A generation backend
declaring ``batch_invariant_logprobs`` instead runs batch-invariant kernels on GPUs: its
logprobs do not depend on the batch, but they are not the trainer's bit for bit (one dtype and
the unfiltered distribution are still asked of it).
Backend-specific conditions (attention kernels, LoRA dropout) are the backends' own checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.config.features import section_declares

if TYPE_CHECKING:
    from posttrain.config.schema import RunConfig
    from posttrain.plugins import PluginHost

EXACT_KEY = "generation.exact_logprobs"
#: The features (:mod:`posttrain.config.features`) of backends that implement it.
EXACT_FEATURE = "supports_exact_logprobs"
BATCH_INVARIANT_FEATURE = "batch_invariant_logprobs"


def rollout_logprobs_are_the_trainers(config: RunConfig, host: PluginHost) -> bool:
    """Whether the rollouts' logprobs are, bit for bit, what the policy computes for the same
    weights: exact logprobs on a generation backend that declares them (a run whose config
    passed :func:`~posttrain.config.validate.check_exact_logprobs`)."""
    generation = config.generation
    return generation.exact_logprobs and section_declares(host, f"generation.{generation.backend}", EXACT_FEATURE)
