"""Methods posttrain adds to vLLM's worker (its ``worker_extension_cls``), run where the
model lives and called by name through ``LLM.collective_rpc``.

Importing this module (vLLM does, in every worker process, before the model is built)
registers posttrain's weight-transfer engine with vLLM (:mod:`posttrain_vllm.transfer`),
so workers in processes of their own (tensor parallel) know it too.
"""

from __future__ import annotations

from typing import Any

from posttrain_vllm import transfer

transfer.register()


class RefitExtension:
    """Methods added to vLLM's worker; ``self`` is that worker."""

    model_runner: Any
    weight_transfer_engine: Any

    def posttrain_after_update(self) -> tuple[list[str], list[str]]:
        """After a weight update: drop caches derived from the old weights and return the
        names of model parameters (vLLM names) that received nothing, and, with checksums,
        those whose values differ from the trainer's."""
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        engine = self.weight_transfer_engine
        return engine.uncovered_parameters(), engine.mismatched_parameters()

    def posttrain_receive_adapter(self, folder: str, lora: dict[str, Any], base_model: str) -> None:
        """Receive one sync of LoRA adapter matrices (PEFT names) and, on the engine's first
        worker, write them with ``lora``'s config (``LoraConfig`` fields) as a PEFT folder at
        ``folder``, for the engine to load (:class:`posttrain_vllm.worker.AdapterSlot`)."""
        from posttrain.backend.adapter_folder import write_adapter_folder
        from posttrain.config.schema import LoraConfig

        tensors = self.weight_transfer_engine.receive_tensors()
        if self.weight_transfer_engine.parallel_config.rank == 0:
            write_adapter_folder(folder, tensors, LoraConfig(**lora), base_model)
