"""An ``hf`` engine whose refit leaves the output head stale: every tensor arrives, the
head's is dropped (as tied embeddings once were in vLLM's reload). Imported by Ray workers
by reference, so it lives in a module of its own."""

from __future__ import annotations

import torch

from posttrain_hf.worker import HFEngineWorker


class StaleHeadEngineWorker(HFEngineWorker):
    @torch.no_grad()
    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().load_weights([(name, tensor) for name, tensor in tensors if not name.startswith("lm_head.")])

    @torch.no_grad()
    def share_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        super().share_weights([(name, tensor) for name, tensor in tensors if not name.startswith("lm_head.")])
