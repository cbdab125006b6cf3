"""Models and layouts the dtensor backend cannot serve are refused when the config is loaded,
before Ray or any worker starts, from the model's config.json: a tensor-parallel plan with
styles it does not implement, head counts the tensor-parallel size does not divide, logit
scaling, an expert-parallel size the experts cannot be split by. A mixture of experts' experts
stay whole under tensor parallelism. The plans it does serve (tied
embeddings, Qwen 3's and Gemma 3's q/k norms, Phi-3's and OLMo 2's gathered projections)
are checked against transformers by the model matrix (tests/e2e/test_model_matrix.py)."""

from __future__ import annotations

import pytest

from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.testing.zoo import build_zoo_model

IMPLEMENTED = ("colwise, colwise_gather_output, embedding_rowwise, replicated_with_grad_allreduce, rowwise, "
               "rowwise_split_input")


def load_config_text(tmp_path, model: str, *overrides: str):
    path = tmp_path / "run.yaml"
    path.write_text(f"policy:\n  backend: dtensor\n  model: {model}\n")
    return load_config(str(path), list(overrides))


def refusal(tmp_path, model: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config_text(tmp_path, model, *overrides)
    return str(error.value)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tensor_parallelism_splits_a_mixture_of_experts_dense_layers_and_keeps_its_experts_whole(tmp_path, arch):
    from transformers import AutoConfig

    from posttrain_dtensor.parallel import dense_plan

    model = str(build_zoo_model(tmp_path / arch, arch, num_key_value_heads=2))
    config = load_config_text(tmp_path, model, "policy.num_workers=2", "policy.tensor_parallel_size=2")
    assert config.policy.tensor_parallel_size == 2
    plan = dense_plan(AutoConfig.from_pretrained(model))
    assert not any(".experts" in name for name in plan)
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["layers.*.self_attn.o_proj"] == "rowwise"


def test_a_plan_style_the_backend_does_not_implement_is_refused_naming_it(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    model = str(build_zoo_model(tmp_path / "llama", "llama", num_key_value_heads=2))
    monkeypatch.setattr(LlamaConfig, "base_model_tp_plan", {"layers.*.self_attn.q_proj": "local_colwise"})
    message = refusal(tmp_path, model, "policy.num_workers=2", "policy.tensor_parallel_size=2")
    assert message == (
        "policy.tensor_parallel_size > 1: the tensor-parallel plan of model type 'llama' uses styles the dtensor "
        "backend does not implement: {'layers.*.self_attn.q_proj': 'local_colwise'}; it "
        f"implements {IMPLEMENTED}. Set policy.tensor_parallel_size=1 for this model (FSDP over policy.num_workers "
        "shards it)"
    )


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(tmp_path, zoo_model):
    message = refusal(tmp_path, zoo_model("qwen3_moe"), "policy.num_workers=3", "policy.moe.expert_parallel_size=3",
                      "policy.train_global_batch_size=12")
    assert message == ("policy.moe.expert_parallel_size=3 does not divide the model's 4 experts per layer; choose a "
                       "size that divides 4 (each rank of an expert-parallel group holds an equal share)")


def test_expert_parallelism_on_a_dense_model_is_refused(tmp_path, zoo_model):
    message = refusal(tmp_path, zoo_model("llama"), "policy.num_workers=2", "policy.moe.expert_parallel_size=2")
    assert message == (
        "policy.moe.expert_parallel_size=2, but model type 'llama' declares no experts to split (its transformers "
        "config has no base_model_ep_plan with a 'moe_tp_experts' module: a dense model, or experts transformers does "
        "not split by expert); set policy.moe.expert_parallel_size: 1"
    )


def test_head_counts_tensor_parallel_does_not_divide_are_refused(tmp_path, zoo_model):
    message = refusal(tmp_path, zoo_model("qwen3"), "policy.num_workers=2", "policy.tensor_parallel_size=2")
    assert message == ("policy.tensor_parallel_size=2 does not divide the model's num_key_value_heads=1; choose a "
                       "tensor-parallel size that divides both attention head counts")


def test_logit_scaling_is_refused(tmp_path):
    model = str(build_zoo_model(tmp_path / "scaled", "llama", logit_scale=0.25))
    assert refusal(tmp_path, model).startswith("policy.model: the model config sets 'logit_scale', which the dtensor "
                                               "backend's chunked logprob head does not apply")


def test_a_model_without_decoder_layers_to_shard_is_refused(tmp_path):
    """GPT-2 keeps its blocks at ``transformer.h``: FSDP over two ranks cannot wrap them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from posttrain.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    assert refusal(tmp_path, str(tmp_path / "gpt2"), "policy.num_workers=2") == (
        "policy.model: cannot find the decoder layers of model type 'gpt2' (expected a ModuleList at "
        "base_model.layers, as Llama, Qwen, Mistral, Gemma, Phi-3 and OLMo 2 have, or at "
        "base_model.language_model.layers, as Qwen-VL has, or base_model.text_model.layers, as Idefics3 has), "
        "which FSDP shards one by one; train it on one rank in float32 (policy.num_workers=1, policy.dtype=float32)"
    )
