"""A hosted ``hf`` engine on the CPU keeps the tensors a refit hands it instead of copying
them (``EngineWorker.share_weights``): the policy's own parameters become the engine's, tied
names included, so the process holds one copy of the weights; the engine then reads them as
they change. Another dtype, and a view into a larger tensor, copy."""

from __future__ import annotations

import pytest
import torch

from posttrain.backend.generation_group import GenerationRequest
from posttrain_hf.worker import HFEngineWorker

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51]]


def greedy(engine: HFEngineWorker) -> list[list[int]]:
    request = GenerationRequest(prompts=PROMPTS, max_new_tokens=[6, 6], temperature=0.0, top_p=1.0, top_k=None,
                                stop_token_ids=[], stop_strings=[[], []], seeds=[0, 1])
    return [c.token_ids for c in engine.generate(request)]


def policy_tensors(path: str) -> dict[str, torch.Tensor]:
    """What a one-rank float32 policy gathers: its own parameters, each tied tensor once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen, tensors = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor.detach()
    return tensors


@pytest.mark.parametrize("arch", ["tiny", "llama_tied"])
def test_a_cpu_engine_keeps_the_policys_tensors_and_reads_them_as_they_change(tiny_model_path, zoo_model, arch):
    path = tiny_model_path if arch == "tiny" else zoo_model(arch)
    engine = HFEngineWorker(model_path=path, dtype="float32", max_batch_size=4, attn_implementation="sdpa")
    before = greedy(engine)
    tensors = policy_tensors(path)
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.add_(torch.randn_like(tensor), alpha=0.5)  # the policy trained: other weights than the folder's
    engine.share_weights(list(tensors.items()))
    own = {name: p.data_ptr() for name, p in engine.model.named_parameters(remove_duplicate=False)}
    assert set(own) <= set(tensors) | {"lm_head.weight"}
    assert all(ptr == tensors[name].data_ptr() for name, ptr in own.items() if name in tensors)
    if arch == "llama_tied":
        assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight
        assert "lm_head.weight" not in tensors
    moved = greedy(engine)
    assert moved != before
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.copy_(torch.randn_like(tensor))  # changed in place, no refit: the engine reads them
    assert greedy(engine) != moved


def test_an_engine_in_another_dtype_copies(tiny_model_path):
    engine = HFEngineWorker(model_path=tiny_model_path, dtype="bfloat16", max_batch_size=4, attn_implementation="sdpa")
    tensors = policy_tensors(tiny_model_path)
    engine.share_weights(list(tensors.items()))
    for name, param in engine.model.named_parameters():
        assert param.dtype == torch.bfloat16 and param.data_ptr() != tensors[name].data_ptr()
        assert torch.equal(param, tensors[name].to(torch.bfloat16))


def test_a_view_into_a_larger_tensor_is_copied_not_kept(tiny_model_path):
    engine = HFEngineWorker(model_path=tiny_model_path, dtype="float32", max_batch_size=4, attn_implementation="sdpa")
    tensors = policy_tensors(tiny_model_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    packed = torch.cat([tensors[name], torch.zeros_like(tensors[name])])  # e.g. one of a fused projection's parts
    view = packed[: tensors[name].shape[0]]
    engine.share_weights([(name, view)])
    kept = dict(engine.model.named_parameters())[name]
    assert kept.data_ptr() != view.data_ptr() and torch.equal(kept, view)
