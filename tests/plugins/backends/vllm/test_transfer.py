"""posttrain's vLLM weight-transfer engine: its init info carries every field of the sync's
TransferInit (a field lost on the way makes the engine and the sender disagree and hang)."""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'posttrain-vllm[cpu]')")

from posttrain.backend.weight_sync import ParamMeta, TransferInit, TransferPlan  # noqa: E402
from posttrain_vllm.transfer import ENGINE_NAME, PosttrainInitInfo, register  # noqa: E402

pytestmark = pytest.mark.vllm


def test_init_info_round_trips_every_field_of_the_transfer_init():
    plan = TransferPlan.build([ParamMeta("a.weight", (3, 4), "float32"), ParamMeta("b", (5,), "bfloat16")], 40)
    init = TransferInit("10.0.0.1", 29500, 3, 5, "gloo", plan, 45.0, "/dev/shm/posttrain-weights-x")
    assert {f.name for f in attrs.fields(TransferInit)} <= set(PosttrainInitInfo.from_init(init)) | {"plan"}
    assert PosttrainInitInfo(**PosttrainInitInfo.from_init(init)).to_init() == init
    assert PosttrainInitInfo(**PosttrainInitInfo.from_init(attrs.evolve(init, shared_memory=None))).to_init().shared_memory is None
    same_gpu = attrs.evolve(init, shared_memory=None, cuda_ipc=(divmod, (7, 2)))  # a rebuild function and its arguments
    mapped = PosttrainInitInfo(**PosttrainInitInfo.from_init(same_gpu)).to_init()
    assert mapped == same_gpu and mapped.map_staging() == (3, 1)


def test_the_engine_is_registered_with_vllms_factory():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    register()
    register()  # idempotent
    assert ENGINE_NAME in WeightTransferEngineFactory._registry
