"""Streaming weight reload inside vLLM's worker process (its ``worker_extension_cls``).

vLLM mixes this class into its GPU/CPU worker, so the methods run where the model lives
and are called by name through ``LLM.collective_rpc``. A refit is
``posttrain_begin_reload``, one ``posttrain_load_bucket`` per bucket, then
``posttrain_finish_reload``: the same steps as ``model_runner.reload_weights`` (layerwise
reload: a layer is re-processed into kernel format, e.g. repacked on CPU, once all its
weights have arrived), spread over several calls. Calling ``reload_weights`` once per
bucket instead would finalise a layer whose weights are split over two buckets (q_proj in
one, k_proj in the next) half-loaded.

Buckets travel as ``torch.save`` bytes: that works in-process and across vLLM's
multiprocess executor (tensor parallel), whose RPC does not carry tensors intact.
"""

from __future__ import annotations

import io
from typing import Any

import torch


class RefitExtension:
    """Methods added to vLLM's worker; ``self`` is that worker."""

    model_runner: Any
    vllm_config: Any

    def posttrain_begin_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._posttrain_loaded: set[str] = set()
        initialize_layerwise_reload(self.model_runner.get_model())

    def posttrain_load_bucket(self, payload: bytes) -> int:
        """Load one bucket (HF names); returns the number of tensors received."""
        from vllm.config import set_current_vllm_config

        tensors = torch.load(io.BytesIO(payload), weights_only=True)
        with set_current_vllm_config(self.vllm_config):
            self._posttrain_loaded |= set(self.model_runner.get_model().load_weights(iter(tensors.items())))
        return len(tensors)

    def posttrain_finish_reload(self) -> list[str]:
        """Process the loaded layers into kernel format, drop caches derived from the old
        weights, and return the names of model parameters that received nothing."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        return sorted({name for name, _ in model.named_parameters()} - self._posttrain_loaded)


def bucket_payload(bucket: dict[str, torch.Tensor]) -> bytes:
    """Serialise a bucket for :meth:`RefitExtension.posttrain_load_bucket` (CPU copies)."""
    buffer = io.BytesIO()
    torch.save({name: tensor.detach().cpu() for name, tensor in bucket.items()}, buffer)
    return buffer.getvalue()
