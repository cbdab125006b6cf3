"""The driver half shared by worker-group generation backends: requests from batches,
sharding bounds, output assembly, model token ids, sampling-config checks, and generate calls
held while a refit runs."""

from __future__ import annotations

import json
import threading
import time

import attrs
import pytest
import torch

from posttrain.backend.engine import EngineWorker, GenerationRequest
from posttrain.backend.generation_group import (
    Completion,
    ModelTokens,
    WorkerGroupGeneration,
    assemble_output,
    build_request,
    check_sampling_config,
    model_tokens,
    split_bounds,
    weight_transport,
)
from posttrain.config.schema import ClusterConfig, GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.errors import ConfigError, DataError
from posttrain.testing.generation import check_output_layout, prompt_batch

PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11]]


def request_for(batch, generation, *, context_length=100, greedy=False):
    return build_request(
        batch, generation, seeds=[11, 12, 13], context_length=context_length, context_key="ctx.key",
        eos_token_ids=(2,), greedy=greedy,
    )


def test_split_bounds_gives_contiguous_near_equal_parts():
    assert split_bounds(5, 2) == [0, 3, 5]
    assert split_bounds(1, 3) == [0, 1, 1, 1]
    assert split_bounds(6, 3) == [0, 2, 4, 6]


def test_request_unpads_prompts_merges_stops_and_caps_budgets():
    generation = GenerationConfig(max_new_tokens=4, temperature=0.5, top_p=0.9, top_k=3, stop_token_ids=[9, 2], stop_strings=["</a>"])
    batch = prompt_batch(PROMPTS, pad_token_id=0, stop_strings=[None, ["x", "</a>"], ["y"]])
    batch["stop_strings"][2] = "y"  # a single string counts as one stop string
    request = request_for(batch, generation, context_length=8)
    assert request.prompts == PROMPTS
    assert request.max_new_tokens == [4, 4, 3]  # the third row has 8 - 5 tokens of room
    assert request.stop_strings == [["</a>"], ["</a>", "x"], ["</a>", "y"]]
    assert request.stop_token_ids == [9, 2] and request.seeds == [11, 12, 13]
    assert (request.temperature, request.top_p, request.top_k) == (0.5, 0.9, 3)
    assert request_for(batch, generation, greedy=True).temperature == 0.0
    assert request.rows(1, 3).prompts == PROMPTS[1:] and request.rows(1, 3).seeds == [12, 13]


def test_ignore_eos_leaves_only_the_configured_stop_tokens():
    batch = prompt_batch(PROMPTS)
    assert request_for(batch, GenerationConfig(stop_token_ids=[9])).stop_token_ids == [9, 2]
    assert request_for(batch, GenerationConfig(stop_token_ids=[9], ignore_eos=True)).stop_token_ids == [9]
    assert request_for(batch, GenerationConfig(ignore_eos=True)).stop_token_ids == []


def test_request_refuses_prompts_that_do_not_fit_or_bad_lengths():
    with pytest.raises(DataError, match=r"row 2 has a 5-token prompt, but the engine context is 5 tokens \(ctx.key\)"):
        request_for(prompt_batch(PROMPTS), GenerationConfig(), context_length=5)
    batch = prompt_batch(PROMPTS)
    batch["input_lengths"] = torch.tensor([3, 0, 5])
    with pytest.raises(DataError, match=r"row 1 has input_lengths 0; expected 1..5"):
        request_for(batch, GenerationConfig())


def test_output_is_prompt_then_completion_right_padded():
    completions = [Completion([20, 2], [-0.5, -0.25], False), Completion([], [], True), Completion([30, 31, 32], [-1.0, -2.0, -3.0], True)]
    out = assemble_output(PROMPTS, completions, pad_token_id=0)
    check_output_layout(out, PROMPTS, pad_token_id=0)
    assert out["output_ids"].tolist() == [[1, 5, 6, 20, 2, 0, 0, 0], [1, 7, 0, 0, 0, 0, 0, 0], [1, 8, 9, 10, 11, 30, 31, 32]]
    assert out["logprobs"][0].tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, 0]
    assert out["logprobs"][2, 5:].tolist() == [-1.0, -2.0, -3.0]
    assert out["generation_lengths"].tolist() == [2, 0, 3]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 2, 8]
    assert out["truncated"].tolist() == [False, True, True]
    empty = assemble_output([], [], pad_token_id=0)
    assert len(empty) == 0 and empty["output_ids"].shape == (0, 0)


def test_model_tokens_prefer_the_generation_config(tiny_model_path, tmp_path):
    assert model_tokens(tiny_model_path) == ModelTokens(eos_token_ids=(2,), pad_token_id=0)
    folder = tmp_path / "model"
    folder.mkdir()
    base = json.loads(open(f"{tiny_model_path}/config.json").read())
    (folder / "config.json").write_text(json.dumps({**base, "eos_token_id": 5, "pad_token_id": None}))
    assert (model_tokens(str(folder)).eos_token_ids, model_tokens(str(folder)).pad_token_id) == ((5,), 5)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8], "pad_token_id": 3}))
    assert (model_tokens(str(folder)).eos_token_ids, model_tokens(str(folder)).pad_token_id) == ((7, 8), 3)


def test_sampling_config_errors_name_the_keys():
    config = RunConfig(
        policy=PolicyConfig(model="m"),
        generation=GenerationConfig(temperature=-1, top_p=0, top_k=0, max_new_tokens=0, num_workers=0,
                                    weight_transport="rdma"),
    )
    with pytest.raises(ConfigError) as error:
        check_sampling_config(config)
    for fragment in (
        "generation.temperature must be >= 0 (0 = greedy), got -1",
        "generation.top_p must be in (0, 1], got 0",
        "generation.top_k must be >= 1 or null (no top-k), got 0",
        "generation.max_new_tokens must be >= 1, got 0",
        "generation.num_workers must be >= 1, got 0",
        "generation.weight_transport must be one of auto, gloo, nccl, got 'rdma'",
    ):
        assert fragment in str(error.value)
    with pytest.raises(ConfigError, match=r"generation.model \(or policy.model\) must name a local Hugging Face folder"):
        check_sampling_config(RunConfig())


def test_the_weight_transport_is_nccl_only_when_both_sides_have_gpus():
    gpu = WorkerResources(gpus=1)
    on_gpus = RunConfig(cluster=ClusterConfig(use_gpus=True), policy=PolicyConfig(resources=gpu),
                        generation=GenerationConfig(resources=gpu))
    assert weight_transport(on_gpus) == "nccl"
    assert weight_transport(attrs.evolve(on_gpus, policy=PolicyConfig())) == "gloo"  # the trainer on the CPU
    assert weight_transport(attrs.evolve(on_gpus, cluster=ClusterConfig())) == "gloo"
    forced = attrs.evolve(on_gpus, generation=GenerationConfig(resources=gpu, weight_transport="gloo"))
    assert weight_transport(forced) == "gloo"


class StampingEngine(EngineWorker):
    """An engine that answers one token per row and notes when each generate call began
    (``time.monotonic``, one clock for every process of the machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.began: list[float] = []

    def generate(self, request: GenerationRequest) -> list[Completion]:
        self.began.append(time.monotonic())
        return [Completion([3], [-0.5], truncated=False) for _ in request.prompts]

    def init_weight_transfer(self, init) -> None:
        raise NotImplementedError

    def receive_weights(self, version: int) -> list[str]:
        raise NotImplementedError

    def calls(self) -> list[float]:
        return self.began


@pytest.mark.ray
def test_a_generate_call_from_another_thread_waits_for_the_refit_in_progress(ray_cluster, tiny_model_path):
    """Asynchronous GRPO generates in a thread of its own while the trainer refits: a call
    made during the refit reaches the engines after it, not ahead of it."""
    config = RunConfig(policy=PolicyConfig(model=tiny_model_path),
                       generation=GenerationConfig(resources=WorkerResources(cpus=0.25)))
    cluster = VirtualCluster(ClusterConfig())
    generation = WorkerGroupGeneration(config, cluster, StampingEngine, context_length=64, context_key="ctx",
                                       worker_kwargs={}, name="stamping")
    try:
        done = threading.Event()
        with generation.refit_window():
            rollout = threading.Thread(target=lambda: (generation.generate(prompt_batch(PROMPTS)), done.set()))
            rollout.start()
            assert not done.wait(1.0)  # held while the refit runs
            ended = time.monotonic()
        rollout.join(60)
        assert done.is_set()
        [began] = generation._group.run_all(StampingEngine.calls)
        assert len(began) == 1 and began[0] > ended
    finally:
        generation.shutdown()
        cluster.shutdown()
