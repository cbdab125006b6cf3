"""The megatron backend's GPU paths (NCCL, Transformer Engine layers, context parallelism,
pipeline schedules on GPUs) against the float64 reference. Run by hand on a GPU machine
(``nox -s gpu`` or ``pytest -m gpu``); each layout is skipped when the machine has fewer
GPUs than it needs, or no Transformer Engine where it needs one. Float32 weights, so the
tolerances are those of the CPU tests scaled for GPU kernels."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.config.schema import OptimizerConfig, WorkerResources  # noqa: E402
from posttrain_megatron.config import MegatronConfig  # noqa: E402
from posttrain_megatron.policy import MegatronPolicy  # noqa: E402
from posttrain_sft.loss import NLLLoss  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.megatron, pytest.mark.ray]

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
TE = MegatronConfig(transformer_impl="transformer_engine")
# name: (needs Transformer Engine, config overrides); one GPU per worker
LAYOUTS = {
    "local_tp2": (False, dict(num_workers=2, tensor_parallel_size=2)),
    "te_tp2_sp": (True, dict(num_workers=2, tensor_parallel_size=2,
                             megatron=MegatronConfig(transformer_impl="transformer_engine", sequence_parallel=True))),
    "te_cp2": (True, dict(num_workers=2, megatron=MegatronConfig(transformer_impl="transformer_engine", context_parallel_size=2))),
    "te_pp2_dp2_distopt": (True, dict(num_workers=4, train_micro_batch_size=2,
                                      optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                                      megatron=MegatronConfig(transformer_impl="transformer_engine",
                                                              pipeline_parallel_size=2, distributed_optimizer=True))),
}


def _layout(name: str):
    """The layout as a test parameter, skipped (before any fixture starts) where it cannot run."""
    needs_te, overrides = LAYOUTS[name]
    gpus = overrides["num_workers"]
    return pytest.param(name, marks=[
        pytest.mark.skipif(torch.cuda.device_count() < gpus, reason=f"{name} needs {gpus} GPUs"),
        pytest.mark.skipif(needs_te and not HAVE_TE, reason=f"{name} needs Transformer Engine"),
    ])


@pytest.mark.parametrize("layout", [_layout(name) for name in LAYOUTS])
def test_gpu_layout_matches_the_reference(layout, llama_path, virtual_cluster, mg):
    overrides = LAYOUTS[layout][1]
    config = mg.policy_config(llama_path, resources=WorkerResources(cpus=1, gpus=1), **overrides)
    config.cluster.use_gpus = True  # ranks given GPUs are a run on GPUs (refused otherwise)
    policy = MegatronPolicy(config, virtual_cluster, name=f"megatron-gpu-{layout}")
    try:
        batch = mg.make_batch()
        got = policy.get_logprobs(batch)["logprobs"]
        torch.testing.assert_close(got.double(), mg.reference_logprobs(llama_path, batch), rtol=0, atol=1e-4)
        before = mg.full_weights(policy)
        ref_loss, ref_grads = mg.reference_nll_step(llama_path, batch)
        metrics = policy.train(batch, NLLLoss())
        if config.policy.optimizer.name == "sgd":  # lr = 1: the weight change is the gradient
            after = mg.full_weights(policy)
            worst = max(float((before[k].double() - after[k].double() - ref_grads[k]).abs().max()) for k in ref_grads)
            assert worst < 1e-4
        assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-4)
    finally:
        policy.shutdown()
