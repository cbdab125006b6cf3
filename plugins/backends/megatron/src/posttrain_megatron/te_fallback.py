"""megatron-core's mixture-of-experts routers without Transformer Engine (always on CPU; on
GPUs without it).

megatron-core 0.16.1 computes router logits with Transformer Engine's GEMM when it is
installed: ``moe_utils`` imports ``te_general_gemm`` inside ``try: import transformer_engine``,
and its router asks ``te_general_gemm is not None`` before falling back to ``torch.mm``. Without
Transformer Engine the name is never defined, so that test raises ``NameError`` at the first
forward of any mixture of experts. :func:`apply` defines it as None, the value the test expects
for "absent", and the router computes with ``torch.mm``.
"""

from __future__ import annotations


def apply() -> None:
    """Define the missing name. Does nothing where Transformer Engine provides it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
