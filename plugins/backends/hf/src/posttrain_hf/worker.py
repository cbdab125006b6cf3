"""The engine of the ``hf`` backend: one transformers model, in a process of its own (an actor) or
inside a policy worker's (``generation.in_policy_workers``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.backend.exact import EXPERTS_IMPLEMENTATION
from posttrain.backend.generation_group import Completion, EngineWorker, GenerationRequest, model_tokens
from posttrain.backend.routing import Routers
from posttrain.backend.weight_sync import BroadcastReceiver, ParamMeta, TransferInit
from posttrain.distributed.placement import uses_cuda
from posttrain.errors import WorkerError, did_you_mean
from posttrain.models.auto import attention_implementation, generative_class
from posttrain_hf.attention import SHARED_KV_SDPA
from posttrain_hf.decode import decode
from posttrain_hf.exact import rescore
from posttrain_hf.small_batch_linear import small_batch_linears
from posttrain_hf.stop_strings import StopStringMatcher


class HFEngineWorker(EngineWorker):
    """Loads ``model_path`` with transformers (on CUDA when the actor has a GPU) and
    serves :class:`~posttrain.backend.generation_group.EngineWorker` calls.

    The tokenizer is loaded from the model folder on first use, and only to check stop
    strings. With ``exact_chunk_size`` (``generation.exact_logprobs``: the policy's
    ``logprob_chunk_size``) every completion's logprobs are computed again as the policy
    computes them (:func:`posttrain_hf.exact.rescore`). With ``record_routes`` (``policy.moe``)
    every completion carries the experts each of its row's tokens went through
    (:class:`~posttrain.backend.routing.Routers`). ``sleep``/``wake_up`` move the model to the CPU and back when it lives on a GPU
    (colocated mode); on CPU they do nothing.
    """

    def __init__(
        self, *, model_path: str, dtype: str, max_batch_size: int, attn_implementation: str,
        exact_chunk_size: int | None = None, record_routes: bool = False,
    ):
        super().__init__()
        from transformers import AutoConfig

        self.device = torch.device("cuda" if uses_cuda() else "cpu")  # CUDA only when the actor was given a GPU
        config = AutoConfig.from_pretrained(model_path)
        kernel = SHARED_KV_SDPA if attn_implementation == "sdpa" else attn_implementation
        kernel = attention_implementation(config, kernel, attn_implementation)
        experts = {"experts_implementation": EXPERTS_IMPLEMENTATION} if exact_chunk_size is not None else {}
        self.model = generative_class(config).from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=kernel, **experts
        ).to(self.device)
        self.model.eval()
        self.routers = Routers(self.model, record=True) if record_routes else None
        self.model_path = model_path
        self.pad_token_id = model_tokens(model_path).pad_token_id  # fills the left padding
        self.max_batch_size = max_batch_size
        self.exact_chunk_size = exact_chunk_size
        self._stop_matcher: StopStringMatcher | None = None
        self._targets = self.model.state_dict(keep_vars=True)  # HF name -> parameter (tied names share one)
        self._receiver: BroadcastReceiver | None = None

    # ------------------------------------------------------------------ generation

    def generate(self, request: GenerationRequest) -> list[Completion]:
        self.wake_up()
        matcher = self.stop_matcher() if any(request.stop_strings) else None
        completions: list[Completion] = []
        for start in range(0, len(request), self.max_batch_size):
            chunk = request.rows(start, start + self.max_batch_size)
            with small_batch_linears(self.model):
                decoded = decode(self.model, chunk, pad_token_id=self.pad_token_id, stop_matcher=matcher, routers=self.routers)
            if self.exact_chunk_size is not None:
                decoded = rescore(self.model, chunk.prompts, decoded, temperature=request.temperature,
                                  chunk_size=self.exact_chunk_size, max_batch_size=self.max_batch_size)
            completions += decoded
        return completions

    def stop_matcher(self) -> StopStringMatcher:
        if self._stop_matcher is None:
            from transformers import AutoTokenizer

            self._stop_matcher = StopStringMatcher(AutoTokenizer.from_pretrained(self.model_path))
        return self._stop_matcher

    # ------------------------------------------------------------------ weights

    def init_weight_transfer(self, init: TransferInit) -> None:
        """Check the plan against the model before joining the group, so that a mismatch
        fails before any byte moves."""
        self.check_weights(init.plan.metas)
        self._receiver = BroadcastReceiver(init)

    def check_weights(self, metas: Sequence[ParamMeta]) -> None:
        """Every name known, shapes equal, every weight covered."""
        sent: set[int] = set()
        for meta in metas:
            target = self._targets.get(meta.name)
            if target is None:
                raise WorkerError(
                    f"the weight sync sends '{meta.name}', which the generation model ({self.model_path}) does not "
                    f"have.{did_you_mean(meta.name, self._targets)}"
                )
            if tuple(target.shape) != meta.shape:
                raise WorkerError(
                    f"the weight sync sends '{meta.name}' with shape {meta.shape}; the generation model expects "
                    f"{tuple(target.shape)}"
                )
            sent.add(id(target))
        missing = [name for name, target in self._targets.items() if id(target) not in sent]
        if missing:
            raise WorkerError(
                f"the weight sync would leave {len(missing)} weight(s) of the generation model unchanged, e.g. "
                f"{missing[:3]}; the policy must export every weight"
            )

    @torch.no_grad()
    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self._targets[name].copy_(tensor)

    @torch.no_grad()
    def share_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """On CPU, each parameter given a tensor of its shape and dtype that is the whole of
        its memory takes that tensor's memory as its data (a tied parameter is one object, so
        every name of it does), its own copy freed: a hosted engine then holds no weights of
        its own. Buffers, other dtypes, views into larger tensors (which keeping would pin) and
        engines on a GPU, which sleep by moving their own weights, copy."""
        for name, tensor in tensors:
            target = self._targets[name]
            whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            keep = (self.device.type == "cpu" and isinstance(target, torch.nn.Parameter) and whole
                    and tensor.dtype == target.dtype and tensor.shape == target.shape and tensor.device == target.device)
            if keep:
                target.data = tensor.detach()
            else:
                target.copy_(tensor)

    @torch.no_grad()
    def receive_weights(self, version: int) -> list[str]:
        if self._receiver is None:
            raise WorkerError("receive_weights() before init_weight_transfer(): the weight sync is not connected")
        self.wake_up()
        self._receiver.receive(self.load_weights)
        self.weight_version = version
        return []

    # ------------------------------------------------------------------ colocation

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def info(self) -> dict[str, Any]:
        """Where the model lives and how big it is (for tests and logs)."""
        return {
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "num_threads": torch.get_num_threads(),
        }
