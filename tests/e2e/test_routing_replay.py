"""GRPO on a mixture of experts with routing replay (``policy.moe``), on CPU with the hf engine.

The engine samples in bfloat16 and the trainer computes in float32, as a GPU run's vLLM and
master weights do: the two sides' routers disagree on some tokens' experts. The same two steps
run three ways, two data-parallel ranks, packed rows:

- ``router_agreement`` alone: the rollout's experts are recorded and compared, not used;
- ``routing_replay: rollout``: the trainer's routers use them: its logprobs of the rollout's
  tokens come closer to the engine's (``token_mult_prob_error``, ``mismatch_kl``), while the
  agreement, what the routers would have chosen alone, is the same as without replay;
- ``routing_replay: rollout`` with the engine in float32: every token routed alike;
- the same with the experts split over the two ranks (``expert_parallel_size: 2``),
  ``routing_replay: previous`` (the trainer replays its own experts of the step's
  previous-logprob pass, which no engine records, and which its workers write into
  TransferQueue, the data plane of that run): the same run;
- ``routing_replay: rollout`` with the megatron backend (megatron-core's routers and replay hook,
  padded rows): the dtensor replay run's first step, loss and gradient norm.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.config.schema import DataPlaneConfig, MoEConfig, SequencePackingConfig, WorkerResources
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_grpo.config import GRPOConfig
from tests.e2e.test_grpo_e2e import assert_finite, make_config, seven_rows, write_rows

pytestmark = pytest.mark.ray

#: How much the near-tied model's router weights are scaled down.
ROUTER_SCALE = 0.02


def run_moe(model, tmp_path, name, *, moe: MoEConfig, engine_dtype: str, plane: str = "memory",
            backend: str = "dtensor", gpus: float = 0) -> list[dict]:
    """Two steps of GRPO on ``model``: two policy ranks on CPUs, or with ``gpus`` one rank and the
    engine colocated on one GPU, each asking for that share of it."""
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2)
    config = make_config(model, tmp_path / name, write_rows(tmp_path / "train.jsonl", seven_rows(4)), grpo,
                         data_plane=DataPlaneConfig(backend=plane))
    # TransferQueue's actors take 2 of the session cluster's 4 CPUs: 2 x 0.25 + 0.5 for the rest
    cpus = (0.25, 0.5) if plane == "transferqueue" else (1.0, 1.0)
    policy = attrs.evolve(config.policy, backend=backend, num_workers=1 if gpus else 2, moe=moe, train_micro_batch_size=4,
                          logprob_micro_batch_size=4,
                          sequence_packing=SequencePackingConfig(enabled=backend == "dtensor", max_tokens_per_row=128),
                          resources=WorkerResources(cpus=cpus[0], gpus=gpus))
    generation = attrs.evolve(config.generation, dtype=engine_dtype, max_new_tokens=16,
                              resources=WorkerResources(cpus=cpus[1], gpus=gpus))
    cluster = attrs.evolve(config.cluster, use_gpus=gpus > 0)
    run_algorithm(attrs.evolve(config, cluster=cluster, policy=policy, generation=generation))
    records = read_metrics(tmp_path / name / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert_finite(record)
    return records


@pytest.fixture(scope="module")
def near_tied_moe(tmp_path_factory) -> str:
    """The zoo's Qwen3-MoE with router weights scaled down, so that the experts' probabilities
    are close and bfloat16 rounding changes some tokens' choice (as routers near a tie do in
    trained models)."""
    from transformers import AutoModelForCausalLM

    from posttrain.testing.zoo import build_zoo_model

    path = build_zoo_model(tmp_path_factory.mktemp("near_tied_moe"), "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    model.save_pretrained(path)
    return str(path)


def test_replay_brings_the_trainers_logprobs_to_the_engines(ray_cluster, near_tied_moe, tmp_path):
    model = near_tied_moe
    measured = run_moe(model, tmp_path, "measured", moe=MoEConfig(router_agreement=True), engine_dtype="bfloat16")
    replayed = run_moe(model, tmp_path, "replayed", moe=MoEConfig(routing_replay="rollout"), engine_dtype="bfloat16")
    same_dtype = run_moe(model, tmp_path, "float32", moe=MoEConfig(routing_replay="rollout"), engine_dtype="float32")
    split = run_moe(model, tmp_path, "float32-ep2", moe=MoEConfig(routing_replay="previous", expert_parallel_size=2),
                    engine_dtype="float32", plane="transferqueue")
    megatron = run_moe(model, tmp_path, "megatron", moe=MoEConfig(routing_replay="rollout"), engine_dtype="bfloat16",
                       backend="megatron")
    layers = {"moe/router_agreement", "moe/router_agreement/layer_00", "moe/router_agreement/layer_01"}
    for without, with_replay, control in zip(measured, replayed, same_dtype, strict=True):
        assert layers <= without.keys() and layers <= with_replay.keys()
        assert without["moe/router_agreement"] < 1.0  # bfloat16 changed some tokens' experts
        assert with_replay["mismatch_kl"] < without["mismatch_kl"] / 10
        assert 1.0 < with_replay["token_mult_prob_error"] < without["token_mult_prob_error"]
        assert control["moe/router_agreement"] == 1.0 and control["mismatch_kl"] < 1e-9
    # One update per step, on policy: the run computes the previous-logprob pass for its experts (it would
    # skip it otherwise), at the training pass's weights, so every real token's recorded experts are the
    # training routers' own: agreement exactly 1, where records misaligned by the two ranks, packed rows,
    # split experts or TransferQueue would disagree (the routers are near a tie). Replay after an update:
    # tests/plugins/backends/dtensor/test_routing_replay.py.
    for control, experts_split in zip(same_dtype, split, strict=True):
        assert experts_split["rollout/mean_reward"] == control["rollout/mean_reward"]
        assert experts_split["moe/router_agreement"] == 1.0 and experts_split["moe/router_agreement/layer_01"] == 1.0
        assert experts_split["mismatch_kl"] < 1e-9
        assert experts_split["loss"] == pytest.approx(control["loss"], abs=1e-6)
        assert experts_split["grad_norm"] == pytest.approx(control["grad_norm"], rel=1e-5)
    # step 1 samples the same tokens with and without replay; the first layer's routers see the
    # same inputs (replay changes what later layers see), so they agree alike
    assert measured[0]["rollout/mean_reward"] == replayed[0]["rollout/mean_reward"]
    assert measured[0]["moe/router_agreement/layer_00"] == replayed[0]["moe/router_agreement/layer_00"]

    # megatron-core's routers given the same rollout's experts at the same weights: the same first step
    for key in ("rollout/mean_reward", "moe/router_agreement", "moe/router_agreement/layer_00"):
        assert megatron[0][key] == replayed[0][key], key
    assert megatron[0]["mismatch_kl"] == pytest.approx(replayed[0]["mismatch_kl"], rel=1e-3, abs=1e-9)
    assert megatron[0]["loss"] == pytest.approx(replayed[0]["loss"], abs=1e-6)
    assert megatron[0]["grad_norm"] == pytest.approx(replayed[0]["grad_norm"], rel=1e-5)
    assert megatron[1]["mismatch_kl"] < measured[1]["mismatch_kl"] / 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_replay_brings_the_trainers_logprobs_to_the_engines(ray_cluster, near_tied_moe, tmp_path):
    """The policy (float32) and the hf engine (bfloat16) colocated on one GPU, the weights synced
    through CUDA IPC: the rollout's experts reach the trainer's routers there too."""
    measured = run_moe(near_tied_moe, tmp_path, "measured", moe=MoEConfig(router_agreement=True),
                       engine_dtype="bfloat16", gpus=0.5)
    replayed = run_moe(near_tied_moe, tmp_path, "replayed", moe=MoEConfig(routing_replay="rollout"),
                       engine_dtype="bfloat16", gpus=0.5)
    for without, with_replay in zip(measured, replayed, strict=True):
        assert without["moe/router_agreement"] < 1.0
        assert with_replay["mismatch_kl"] < without["mismatch_kl"] / 10
        assert 1.0 < with_replay["token_mult_prob_error"] < without["token_mult_prob_error"]
