"""The ``hf`` generation backend end to end on Ray: the generation contract against
transformers (greedy parity, refit parity, stop strings, truncation) and the errors a
user sees."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import GenerationConfig, PolicyConfig, RunConfig, WorkerResources
from posttrain.distributed import VirtualCluster
from posttrain.errors import DataError, WorkerError
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import ExportedWeights, GenerationContract, prompt_batch, stop_token_for

pytestmark = pytest.mark.ray

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63, 7, 8, 9, 10, 11], [1, 12]]
EOS = [2]


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def contract(ray_cluster, tiny_model_path, hf_model):
    stop_token = stop_token_for(hf_model, PROMPTS[0], position=3, eos_token_ids=EOS)
    config = RunConfig(
        seed=3,
        policy=PolicyConfig(model=tiny_model_path),
        generation=GenerationConfig(
            backend="hf", temperature=0.7, max_new_tokens=12, stop_token_ids=[stop_token],
            resources=WorkerResources(cpus=1),
        ),
    )
    generation = plugin_host().generation_backends["hf"](config, VirtualCluster(config.cluster))
    yield GenerationContract(
        generation, hf_model, tiny_model_path, PROMPTS, temperature=0.7, max_new_tokens=12,
        stop_token_ids=[stop_token], eos_token_ids=EOS,
    )
    generation.shutdown()


def test_greedy_equals_transformers_generate(contract):
    contract.check_greedy()


def test_refit_then_sampled_logprobs_match_a_transformers_forward(contract):
    contract.check_refit(bucket_bytes=20_000)  # a few tensors per bucket


def test_stop_strings_and_truncation(contract, tiny_model_path):
    from transformers import AutoTokenizer

    contract.check_stop_strings(AutoTokenizer.from_pretrained(tiny_model_path))


def test_release_refit_wake_cycle(contract):
    contract.check_colocated_cycle()


def test_each_call_draws_new_samples(contract):
    contract.check_fresh_samples()


def test_prompt_longer_than_the_context_is_refused(contract):
    with pytest.raises(DataError, match=r"row 1 has a 1100-token prompt, but the engine context is 1024 tokens"):
        contract.generation.generate(prompt_batch([[1, 5], [1] + [5] * 1099]))


def test_refit_with_a_wrong_or_missing_weight_names_it(contract, hf_model):
    weights = dict(hf_model.state_dict())
    weights["model.layers.0.mlp.gate_prj.weight"] = weights.pop("model.layers.0.mlp.gate_proj.weight")
    with pytest.raises(WorkerError, match=r"'model.layers.0.mlp.gate_prj.weight'.*Did you mean 'model.layers.0.mlp.gate_proj.weight'"):
        refit(ExportedWeights(weights), contract.generation, bucket_bytes=1 << 30)
    missing = {k: v for k, v in hf_model.state_dict().items() if "lm_head" not in k}
    with pytest.raises(WorkerError, match=r"engine 0 init_weight_transfer\(\) failed: .*would leave 1 weight\(s\) of the "
                                          r"generation model unchanged, e.g. \['lm_head.weight'\]"):
        refit(ExportedWeights(missing), contract.generation, bucket_bytes=1 << 30)
    refit(ExportedWeights(hf_model.state_dict()), contract.generation, bucket_bytes=1 << 30)  # as it was
