"""The megatron backend's pure pieces, without Ray or torch.distributed: Hugging Face <->
megatron-core weight conversion and tensor-parallel slicing, the architecture mapping and
its refusals, row layouts (context-parallel chunks, next-token labels), config validation
and the CPU workarounds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install posttrain-megatron)")

from posttrain.config.schema import OptimizerConfig  # noqa: E402
from posttrain.errors import ConfigError  # noqa: E402
from posttrain_megatron import cpu_compat  # noqa: E402
from posttrain_megatron.config import MegatronConfig, validate_policy_config  # noqa: E402
from posttrain_megatron.convert import (  # noqa: E402
    Architecture,
    hf_names,
    hf_shapes,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    tp_merge,
    tp_shard,
)
from posttrain_megatron.head import cp_positions, make_rows, row_multiple  # noqa: E402

pytestmark = pytest.mark.megatron


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the file holds the embedding once
    return model.config, state


@pytest.fixture(scope="module")
def qwen3_moe_path(tmp_path_factory):
    """A Qwen3-MoE whose first layer is dense (``mlp_only_layers``), the second experts."""
    from posttrain.testing.zoo import build_zoo_model

    return str(build_zoo_model(tmp_path_factory.mktemp("qwen3_moe_dense0"), "qwen3_moe", mlp_only_layers=[0]))


@pytest.fixture(params=["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def hf_model(request, llama_path, qwen2_path, zoo_model, qwen3_moe_path):
    """Llama; Qwen2 (q/k/v biases, tied); Qwen3 (q/k norms, tied); Qwen3-MoE (a dense layer, then
    experts); Mixtral (experts in every layer)."""
    paths = {"llama": llama_path, "qwen2": qwen2_path, "qwen3": zoo_model("qwen3"), "qwen3_moe": qwen3_moe_path}
    return _hf_model(paths.get(request.param) or zoo_model(request.param))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_hf_megatron_hf_round_trip_is_exact(hf_model, tp, fused_norms):
    """HF -> whole megatron tensors -> tensor-parallel slices -> whole -> HF gives back every
    tensor bit for bit, under the same names, in the state dict's order."""
    config, hf = hf_model
    arch = Architecture.from_hf_config(config)
    mg = hf_to_megatron(arch, hf, tp_size=tp, fused_norms=fused_norms)
    assert list(mg) == megatron_names(arch, fused_norms=fused_norms)
    merged = {name: tp_merge(name, [tp_shard(name, t, r, tp) for r in range(tp)]) for name, t in mg.items()}
    back = megatron_to_hf(arch, merged, fused_norms=fused_norms)
    assert list(back) == list(hf) == hf_names(arch)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    assert {n: tuple(t.shape) for n, t in hf.items()} == hf_shapes(arch)


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "mixtral"])
def test_experts_are_read_one_at_a_time_from_the_checkpoints_own_names(arch_name, zoo_model, qwen3_moe_path):
    """A checkpoint stores each expert under its family's names; every expert's slice of
    transformers' packed tensors (gate rows first) is read from them, and the router too."""
    from safetensors.torch import load_file

    from posttrain_megatron.convert import checkpoint_names, expert_of, one_expert

    path = qwen3_moe_path if arch_name == "qwen3_moe" else zoo_model(arch_name)
    config, hf = _hf_model(path)
    arch = Architecture.from_hf_config(config)
    on_disk = load_file(f"{path}/model.safetensors")
    layer = 1
    p = f"model.layers.{layer}.mlp."
    assert torch.equal(on_disk[checkpoint_names(arch, p + "gate.weight")[0]], hf[p + "gate.weight"])
    for e in range(arch.num_experts):
        gate_up = torch.cat([on_disk[n] for n in checkpoint_names(arch, p + "experts.gate_up_proj", e)])
        down = torch.cat([on_disk[n] for n in checkpoint_names(arch, p + "experts.down_proj", e)])
        assert torch.equal(gate_up, hf[p + "experts.gate_up_proj"][e])
        assert torch.equal(down, hf[p + "experts.down_proj"][e])
    names = checkpoint_names(arch, p + "experts.gate_up_proj", 3)
    assert names == ([f"{p}experts.3.gate_proj.weight", f"{p}experts.3.up_proj.weight"] if arch_name == "qwen3_moe" else
                     [f"model.layers.{layer}.block_sparse_moe.experts.3.w1.weight",
                      f"model.layers.{layer}.block_sparse_moe.experts.3.w3.weight"])
    stacked = f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight"
    assert expert_of(one_expert(stacked, 3)) == (stacked, 3)
    assert arch.moe_layers == ((False, True) if arch_name == "qwen3_moe" else (True, True))


def test_fused_layouts_follow_megatron_core(qwen2_path):
    """q/k/v rows are grouped per key/value head (its query heads, its key, its value), gate
    rows precede up rows, and the vocabulary is zero-padded to a multiple of tp."""
    config, hf = _hf_model(qwen2_path)
    arch = Architecture.from_hf_config(config)
    mg = hf_to_megatron(arch, hf, tp_size=4)
    d, per_group = arch.head_dim, arch.num_heads // arch.num_kv_heads
    p = "model.layers.1.self_attn."
    for kind in ("weight", "bias"):
        qkv = mg[f"decoder.layers.1.self_attention.linear_qkv.{kind}"]
        q, k, v = hf[p + f"q_proj.{kind}"], hf[p + f"k_proj.{kind}"], hf[p + f"v_proj.{kind}"]
        for g in range(arch.num_kv_heads):
            rows = qkv[g * (per_group + 2) * d:(g + 1) * (per_group + 2) * d]
            assert torch.equal(rows[:per_group * d], q[g * per_group * d:(g + 1) * per_group * d])
            assert torch.equal(rows[per_group * d:(per_group + 1) * d], k[g * d:(g + 1) * d])
            assert torch.equal(rows[(per_group + 1) * d:], v[g * d:(g + 1) * d])
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:arch.ffn_hidden_size], hf["model.layers.0.mlp.gate_proj.weight"])
    # rank 1 of 2 holds the second half of gate, then the second half of up
    half = arch.ffn_hidden_size // 2
    shard = tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert torch.equal(shard[:half], hf["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(shard[half:], hf["model.layers.0.mlp.up_proj.weight"][half:])
    embed = mg["embedding.word_embeddings.weight"]
    assert embed.shape[0] == 104 and arch.vocab_size == 103 and not embed[103:].any()
    assert torch.equal(mg["output_layer.weight"], embed)  # tied: the last stage's copy


def test_architecture_maps_the_hf_config(llama_path, qwen2_path):
    llama = Architecture.from_hf_config(_hf_model(llama_path)[0])
    kwargs = llama.transformer_config_kwargs()
    assert (kwargs["num_attention_heads"], kwargs["num_query_groups"], kwargs["kv_channels"]) == (4, 2, 16)
    assert kwargs["add_qkv_bias"] is False and kwargs["gated_linear_unit"] and kwargs["normalization"] == "RMSNorm"
    assert llama.gpt_model_kwargs(2)["share_embeddings_and_output_weights"] is False
    qwen = Architecture.from_hf_config(_hf_model(qwen2_path)[0])
    assert qwen.transformer_config_kwargs()["add_qkv_bias"] is True
    assert qwen.gpt_model_kwargs(1)["share_embeddings_and_output_weights"] is True
    assert qwen.rms_norm_eps == 1e-6 and qwen.gpt_model_kwargs(4)["vocab_size"] == 104


def test_unsupported_architectures_are_refused_with_the_field(llama_path):
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ConfigError, match="converts model types llama, qwen2, qwen3, mistral, qwen3_moe, mixtral; this model's config.json has "
                                          "model_type 'gpt2'. Use policy.backend=dtensor for it"):
        Architecture.from_hf_config(GPT2Config())
    with pytest.raises(ConfigError, match="sets hidden_act='gelu'"):
        Architecture.from_hf_config(LlamaConfig(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="sets attention_bias=True"):
        Architecture.from_hf_config(LlamaConfig(attention_bias=True))
    with pytest.raises(ConfigError, match="sets rope type='yarn'"):
        Architecture.from_hf_config(LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    arch = Architecture.from_hf_config(LlamaConfig(rope_parameters=llama3))
    assert (arch.rope_theta, arch.rope_scaling_factor) == (5e5, 8.0)
    with pytest.raises(ConfigError, match="rope type='llama3'"):
        Architecture.from_hf_config(LlamaConfig(rope_parameters={**llama3, "high_freq_factor": 2.0}))


def test_sliding_windows_map_to_megatron_window_settings_per_layer():
    """transformers' window (a query sees itself and ``window - 1`` keys before it) is
    megatron-core's ``window_size`` ``(window - 1, 0)``, in Mistral's every layer and in the
    layers Qwen2's ``layer_types`` mark; no window settings without windowed layers."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    mistral = Architecture.from_hf_config(MistralConfig(num_hidden_layers=3, sliding_window=16)).transformer_config_kwargs()
    assert (mistral["window_size"], mistral["window_attn_skip_freq"]) == ((15, 0), [1, 1, 1])
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    kwargs = Architecture.from_hf_config(qwen).transformer_config_kwargs()
    assert (kwargs["window_size"], kwargs["window_attn_skip_freq"]) == ((15, 0), [0, 1, 1])
    for unwindowed in (Qwen2Config(num_hidden_layers=3), MistralConfig(sliding_window=None), LlamaConfig()):
        assert "window_size" not in Architecture.from_hf_config(unwindowed).transformer_config_kwargs()


@pytest.mark.parametrize(("arch", "model_type", "caps"), [
    ("gemma2", "gemma2", " (and megatron-core 0.16 has no setting for its attn_logit_softcapping=5.0, "
                         "final_logit_softcapping=5.0)"),
    ("gemma3", "gemma3_text", ""),
], ids=["gemma2", "gemma3"])
def test_gemma_models_are_refused_before_any_worker_starts(zoo_model, mg, arch, model_type, caps):
    """Config validation (what the loader and the policy's constructor run, before Ray) reads
    the model's config.json and refuses it with the backend to use instead."""
    from posttrain.config.validate import validate_config

    message = (f"policy.model: the megatron backend converts model types llama, qwen2, qwen3, mistral, qwen3_moe, mixtral; this model's "
               f"config.json has model_type '{model_type}'{caps}. Use policy.backend=dtensor for it")
    with pytest.raises(ConfigError) as refused:
        validate_config(mg.policy_config(zoo_model(arch)))
    assert str(refused.value) == message


def test_parallel_sizes_the_model_does_not_divide_are_refused(llama_path):
    from posttrain.config.schema import PolicyConfig
    from posttrain_megatron.config import check_parallel_sizes

    arch = Architecture.from_hf_config(_hf_model(llama_path)[0])  # 4 heads, 2 key/value heads, 2 layers
    check_parallel_sizes(arch, PolicyConfig(num_workers=4, tensor_parallel_size=2), MegatronConfig(pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="policy.tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"):
        check_parallel_sizes(arch, PolicyConfig(num_workers=4, tensor_parallel_size=4), MegatronConfig())
    with pytest.raises(ConfigError,
                       match="policy.megatron.pipeline_parallel_size=3 does not divide the model's num_hidden_layers=2"):
        check_parallel_sizes(arch, PolicyConfig(num_workers=3), MegatronConfig(pipeline_parallel_size=3))


# ---------------------------------------------------------------- rows


def test_rows_carry_next_token_labels_and_pad_to_the_multiple():
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])
    rows = make_rows(ids, torch.tensor([3, 2]), multiple=4, cp_size=1, cp_rank=0)
    assert rows.width == 4 and rows.input_ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert rows.labels.tolist() == [[6, 7, 0, 0], [9, 0, 0, 0]]
    assert rows.scored.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert row_multiple(tp_size=2, cp_size=3, sequence_parallel=True) == 6
    assert row_multiple(tp_size=2, cp_size=1, sequence_parallel=False) == 1


class _Group:
    """Just the size and rank megatron-core's batch splitter asks a process group for
    (context parallelism itself needs Transformer Engine on a GPU)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_positions_are_megatron_cores_split(cp, monkeypatch):
    """Each rank's positions select what megatron-core's get_batch_on_this_cp_rank gives
    it (the layout its context-parallel attention expects), and together cover every
    position once."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # it reads sizes only then
    width = 4 * cp
    tokens = torch.arange(2 * width).reshape(2, width)
    seen = []
    for rank in range(cp):
        split = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=_Group(cp, rank))["tokens"]
        positions = cp_positions(width, cp, rank)
        assert torch.equal(split, tokens[:, positions])
        rows = make_rows(tokens, torch.tensor([width, width - 3]), 2 * cp, cp, rank)
        assert torch.equal(rows.input_ids, split) and torch.equal(rows.positions, positions)
        seen += positions.tolist()
    assert sorted(seen) == list(range(width))


# ---------------------------------------------------------------- config


def test_mixture_of_experts_options_the_model_cannot_take_are_refused_before_any_worker_starts(mg, llama_path,
                                                                                            zoo_model, tmp_path):
    from posttrain.config.schema import MoEConfig
    from posttrain.testing.zoo import build_zoo_model

    def refused(path, **overrides) -> str:
        with pytest.raises(ConfigError) as info:
            validate_policy_config(mg.policy_config(path, **overrides))
        return str(info.value)

    mixtral = zoo_model("mixtral")  # 4 experts per layer
    assert refused(mixtral, num_workers=6, moe=MoEConfig(expert_parallel_size=3)) == (
        "policy.moe.expert_parallel_size=3 does not divide the model's 4 experts per layer; choose a size that "
        "divides 4 (each rank of an expert-parallel group holds an equal share)")
    assert refused(llama_path, num_workers=2, moe=MoEConfig(expert_parallel_size=2)) == (
        "policy.moe.expert_parallel_size=2, but model type 'llama' has no experts to split; set "
        "policy.moe.expert_parallel_size: 1")
    assert refused(llama_path, moe=MoEConfig(routing_replay="rollout")) == (
        "policy.moe.routing_replay: model type 'llama' has no experts to route; turn it off for this model")
    assert refused(mixtral, num_workers=2, moe=MoEConfig(routing_replay="previous"),
                   megatron=MegatronConfig(pipeline_parallel_size=2)) == (
        "policy.moe.routing_replay: previous records each token's experts in one rank's forward, which "
        "policy.megatron.pipeline_parallel_size splits over ranks in the megatron backend; use routing_replay: "
        "rollout, or set policy.megatron.pipeline_parallel_size: 1")
    validate_policy_config(mg.policy_config(mixtral, num_workers=2, moe=MoEConfig(routing_replay="rollout"),
                                            megatron=MegatronConfig(pipeline_parallel_size=2)))
    mixtral_kv2 = str(build_zoo_model(tmp_path / "mixtral_kv2", "mixtral", num_key_value_heads=2))
    assert refused(mixtral_kv2, num_workers=2, tensor_parallel_size=2) == (
        "policy.tensor_parallel_size=2 on a mixture of experts needs policy.megatron.sequence_parallel: true in the "
        "megatron backend (megatron-core trains experts split over tensor-parallel ranks only on a sequence split over "
        "them); set it")


def test_validation_names_the_keys(mg):
    def check(message, **overrides):
        megatron = overrides.pop("megatron", None)
        with pytest.raises(ConfigError, match=message):
            validate_policy_config(mg.policy_config("/nowhere", megatron=megatron, **overrides))

    check("policy.dtype: the megatron backend trains in float32, bfloat16, got 'float16'", dtype="float16")
    check("policy.megatron.transformer_impl: expected one of local, transformer_engine, got 'te'",
          megatron=MegatronConfig(transformer_impl="te"))
    check("policy.optimizer.name: expected one of adamw, adam, sgd, got 'lion'",
          optimizer=OptimizerConfig(name="lion"))
    check("policy.megatron.distributed_optimizer needs policy.optimizer.name adamw or adam", num_workers=2,
          megatron=MegatronConfig(distributed_optimizer=True))
    check("policy.megatron.sequence_parallel splits activations over tensor-parallel ranks and needs "
          r"policy.tensor_parallel_size > 1", megatron=MegatronConfig(sequence_parallel=True))
    check("policy.megatron.context_parallel_size=2 needs policy.megatron.transformer_impl=transformer_engine",
          num_workers=2, megatron=MegatronConfig(context_parallel_size=2))
    cfg = mg.policy_config("/nowhere")
    cfg.policy.sequence_packing.enabled = True
    with pytest.raises(ConfigError, match="policy.sequence_packing is not implemented by the megatron backend; use "
                                          "policy.dynamic_batching"):
        validate_policy_config(cfg)
    validate_policy_config(mg.policy_config("/nowhere", num_workers=4, tensor_parallel_size=2,
                                            megatron=MegatronConfig(pipeline_parallel_size=2, sequence_parallel=True)))


def test_plugin_registers_backend_section_and_checks_only_megatron_policies(mg):
    from posttrain.plugins import plugin_host
    from posttrain_megatron.plugin import make_policy

    host = plugin_host()
    assert host.policy_backends["megatron"] is make_policy
    assert host.config_sections["policy.megatron"] is MegatronConfig
    cfg = mg.policy_config("/nowhere", dtype="float16")
    with pytest.raises(ConfigError, match="policy.dtype: the megatron backend"):
        host.hook.posttrain_validate_config(config=cfg)
    cfg.policy.backend = "dtensor"
    cfg.policy.dtype = "bfloat16"
    cfg.sections["policy.megatron"] = MegatronConfig(transformer_impl="te")
    host.hook.posttrain_validate_config(config=cfg)  # another backend's business


# ---------------------------------------------------------------- CPU workarounds


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workarounds apply only without CUDA")
def test_cuda_as_cpu_turns_cuda_requests_into_the_cpu_only_while_active():
    with cpu_compat.cuda_as_cpu():
        made = torch.zeros(2, device="cuda")
        moved = torch.ones(1).to("cuda:0")
        assert made.device.type == "cpu" and moved.device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions still convert
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.ones(1).type() == "torch.FloatTensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU workarounds apply only without CUDA")
def test_apply_patches_the_process_wide_cuda_calls():
    """In a fresh interpreter (the patches are process-wide): before, these calls fail;
    after apply(), the current device is the CPU and synchronising is a no-op."""
    code = (
        "import torch\n"
        "from posttrain_megatron import cpu_compat\n"
        "try:\n    torch.cuda.current_device(); print('no error')\n"
        "except (AssertionError, RuntimeError):\n    print('raised')\n"
        "cpu_compat.apply(); cpu_compat.apply()\n"
        "print(torch.cuda.current_device(), torch.cuda.synchronize(), torch.cuda.empty_cache())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["raised", "cpu None None"]
