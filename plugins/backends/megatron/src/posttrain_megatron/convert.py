"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral weights <-> megatron-core
``GPTModel`` weights.

Three layers, each a pure function of tensors:

- :class:`Architecture`: the decoder's shape read from the Hugging Face config (refusing
  what a megatron-core ``GPTModel`` would compute differently), and the
  ``TransformerConfig`` / ``GPTModel`` arguments it maps to. Sliding windows map to
  megatron-core's ``window_size`` (a query sees itself and the ``window - 1`` tokens before
  it, as in transformers), per layer through ``window_attn_skip_freq``; attention or
  final-logit soft-capping (Gemma 2), which megatron-core 0.16 has no setting for, is refused
  with the rest of the Gemma architecture.
- :func:`hf_sources`, :func:`to_megatron`, :func:`to_hf`: one whole (unsharded) megatron
  tensor (global layer numbers) from, or back to, the Hugging Face tensors it is made of,
  so a rank loads or exports one tensor at a time; :func:`hf_to_megatron` and
  :func:`megatron_to_hf` do a whole model. Megatron fuses q/k/v into ``linear_qkv``
  grouped by key/value head (each group's query heads, then its key, then its value) and
  gate/up into ``linear_fc1`` (gate rows first), and pads the vocabulary to a multiple of
  the tensor-parallel size.
- :func:`tp_shard` / :func:`tp_merge`: a whole megatron tensor <-> the slices the
  tensor-parallel ranks hold.

Mixtures of experts. Hugging Face names here are transformers' in-memory names, the ones the
policy's weight exchange uses (refit, export): each layer's experts are two packed tensors,
``mlp.experts.gate_up_proj`` [experts, 2 x ffn, hidden] (gate rows first) and
``mlp.experts.down_proj`` [experts, hidden, ffn], and its router ``mlp.gate.weight``. megatron-core
keeps one module per expert (``mlp.experts.local_experts.<e>.linear_fc1.weight``, the rank's
experts numbered from 0) and the router as ``mlp.router.weight``. Whole megatron tensors name
each expert by its number in the layer (:func:`expert_of`), and the experts of a layer stacked
as ``mlp.experts.linear_fc1.weight`` / ``linear_fc2.weight`` (which the packed tensors are, as
they are). A checkpoint stores every expert on its own (:func:`checkpoint_names`), read one
expert at a time.

Layer norms sit in their own modules in megatron-core's local layer spec
(``input_layernorm``, ``pre_mlp_layernorm``) and inside the next linear layer in the
Transformer Engine spec (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``);
``fused_norms`` picks the naming.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from posttrain.errors import ConfigError

#: Hugging Face ``model_type`` values this backend converts.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")

#: Mixture-of-experts model type -> (the checkpoint's module of a layer's experts and router, the
#: checkpoint names of each expert's gate, up and down projections).
CHECKPOINT_EXPERTS = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}

#: Soft-cap fields of Hugging Face configs (Gemma 2): megatron-core 0.16 caps neither scores nor logits.
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


@attrs.frozen
class Architecture:
    """The decoder's shape, from a Hugging Face config (see :meth:`from_hf_config`)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    qkv_bias: bool
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen 3: an RMS norm over each query and key head (megatron-core's qk_layernorm)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling_factor: float | None = None  # Llama 3.x frequency scaling
    sliding_window: int | None = None  # tokens a query sees (itself included) in a windowed layer
    window_layers: tuple[bool, ...] = ()  # per layer: whether it attends within the window
    num_experts: int = 0  # experts per mixture-of-experts layer (0: a dense model)
    experts_per_token: int = 0
    expert_ffn_hidden_size: int = 0
    renormalize_routes: bool = True  # the k chosen experts' weights scaled to sum to 1 (Qwen3-MoE's norm_topk_prob)
    moe_layers: tuple[bool, ...] = ()  # per layer: whether its MLP is the experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def has_experts(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based, of the whole model) is a mixture-of-experts layer."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_hf_config(cls, cfg: Any) -> Architecture:
        """Read a ``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MistralConfig``,
        ``Qwen3MoeConfig`` or ``MixtralConfig``; raise
        :class:`ConfigError` naming the config field for anything megatron-core's ``GPTModel``
        would compute differently."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            caps = [f"{key}={getattr(cfg, key)!r}" for key in SOFTCAPS if getattr(cfg, key, None)]
            why = f" (and megatron-core 0.16 has no setting for its {', '.join(caps)})" if caps else ""
            raise ConfigError(
                f"policy.model: the megatron backend converts model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                f"this model's config.json has model_type '{model_type}'{why}. Use policy.backend=dtensor for it"
            )

        def refuse(field: str, found: Any, expected: str) -> ConfigError:
            return ConfigError(
                f"policy.model: config.json sets {field}={found!r}, which the megatron backend does not convert "
                f"(expected {expected}); use policy.backend=dtensor for this model"
            )

        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise refuse("hidden_act", act, "'silu'")
        if getattr(cfg, "mlp_bias", False):
            raise refuse("mlp_bias", True, "false")
        if model_type in ("llama", "qwen3", "qwen3_moe") and getattr(cfg, "attention_bias", False):
            raise refuse("attention_bias", True, "false: megatron-core has no bias on o_proj alone")
        for field in ("attention_dropout", "hidden_dropout", "router_jitter_noise"):
            if getattr(cfg, field, 0.0):
                raise refuse(field, getattr(cfg, field), "0.0")
        heads = cfg.num_attention_heads
        rope_theta, scaling = _rope(cfg, refuse)
        window, window_layers = _windows(cfg)
        return cls(
            model_type=model_type,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            qkv_bias=model_type == "qwen2",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_scaling_factor=scaling,
            sliding_window=window,
            window_layers=window_layers,
            **_experts(cfg),
        )

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``tp_size`` (megatron splits it evenly);
        the extra rows are zeros and never enter a softmax."""
        return -(-self.vocab_size // tp_size) * tp_size

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """The architecture part of megatron-core's ``TransformerConfig``."""
        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **self._window_kwargs(),
            **self._expert_kwargs(),
        )

    def _expert_kwargs(self) -> dict[str, Any]:
        """megatron-core's mixture-of-experts settings: softmax over the experts, the top k; with
        ``renormalize_routes`` the softmax of the k chosen logits (the same weights), without it
        the top k of the softmax over all. No load-balancing loss; the experts in the layers
        ``moe_layer_freq`` marks 1."""
        if not self.is_moe:
            return {}
        return dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.experts_per_token,
            moe_ffn_hidden_size=self.expert_ffn_hidden_size,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not self.renormalize_routes,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_layer_freq=[int(m) for m in self.moe_layers],
        )

    def _window_kwargs(self) -> dict[str, Any]:
        """megatron-core's sliding-window settings: ``window_size`` ``(window - 1, 0)`` (keys
        back, keys ahead), in the layers ``window_attn_skip_freq`` marks 1."""
        if self.sliding_window is None:
            return {}
        return dict(window_size=(self.sliding_window - 1, 0), window_attn_skip_freq=[int(w) for w in self.window_layers])

    def gpt_model_kwargs(self, tp_size: int) -> dict[str, Any]:
        """Keyword arguments of ``GPTModel`` besides the config and layer spec."""
        return dict(
            vocab_size=self.padded_vocab_size(tp_size),
            max_sequence_length=self.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=self.rope_theta,
            rope_scaling=self.rope_scaling_factor is not None,
            rope_scaling_factor=self.rope_scaling_factor or 8.0,
            share_embeddings_and_output_weights=self.tie_word_embeddings,
        )


def _experts(cfg: Any) -> dict[str, Any]:
    """The :class:`Architecture` fields of a mixture of experts (none for a dense model): every
    layer of a Mixtral; the layers of a Qwen3-MoE that transformers makes sparse (not in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th)."""
    if cfg.model_type == "mixtral":
        return dict(num_experts=cfg.num_local_experts, experts_per_token=cfg.num_experts_per_tok,
                    expert_ffn_hidden_size=cfg.intermediate_size, moe_layers=(True,) * cfg.num_hidden_layers)
    if cfg.model_type != "qwen3_moe":
        return {}
    only_mlp, step = set(cfg.mlp_only_layers or ()), cfg.decoder_sparse_step
    layers = tuple(i not in only_mlp and cfg.num_experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))
    return dict(num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                expert_ffn_hidden_size=cfg.moe_intermediate_size, renormalize_routes=bool(cfg.norm_topk_prob),
                moe_layers=layers)


def _windows(cfg: Any) -> tuple[int | None, tuple[bool, ...]]:
    """``(sliding_window, per-layer windowed flags)`` as transformers applies them: every
    layer of a Mistral or Mixtral model with a window, the layers ``layer_types`` marks
    ``sliding_attention`` otherwise (Qwen2); ``(None, ())`` without windowed layers."""
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type in ("mistral", "mixtral"):
        layers = (True,) * cfg.num_hidden_layers
    else:
        layers = tuple(kind == "sliding_attention" for kind in getattr(cfg, "layer_types", None) or ())
    if window is None or not any(layers):
        return None, ()
    return int(window), layers


#: Llama 3.x rope scaling as megatron-core implements it (only ``factor`` is a parameter).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(cfg: Any, refuse) -> tuple[float, float | None]:
    """``(rope_theta, llama3 scaling factor or None)`` from either transformers layout
    (``rope_parameters`` in 5.x; ``rope_theta`` + ``rope_scaling`` before)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:
        params = {"rope_theta": getattr(cfg, "rope_theta", 10000.0), **(getattr(cfg, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3" and all(float(params.get(k, -1)) == v for k, v in _MEGATRON_LLAMA3_ROPE.items()):
        return theta, float(params["factor"])
    raise refuse("rope type", rope_type, "'default', or 'llama3' with low_freq_factor 1, high_freq_factor 4, "
                 "original_max_position_embeddings 8192")


# ---------------------------------------------------------------------------- names


def layer_names(fused_norms: bool, *, experts: bool = False) -> dict[str, str]:
    """Megatron name (inside ``decoder.layers.<i>.``) of each per-layer Hugging Face tensor
    that maps one to one, in a dense layer or (``experts``) a mixture-of-experts layer (whose
    norm before the MLP is a module of its own in either layer spec)."""
    names = {
        "input_layernorm.weight": (
            "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
        ),
        "post_attention_layernorm.weight": (
            "mlp.linear_fc1.layer_norm_weight" if fused_norms and not experts else "pre_mlp_layernorm.weight"
        ),
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    }
    return {**names, **(EXPERT_NAMES if experts else {"mlp.down_proj.weight": "mlp.linear_fc2.weight"})}


#: Megatron name (inside ``decoder.layers.<i>.``) of each per-layer Hugging Face tensor of a
#: mixture-of-experts layer: the router, and every expert's weights stacked.
EXPERT_NAMES = {
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.linear_fc1.weight",
    "mlp.experts.down_proj": "mlp.experts.linear_fc2.weight",
}
#: The order of a mixture-of-experts layer's tensors in transformers' state dict, by model type.
_EXPERT_ORDER = {
    "qwen3_moe": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"),
    "mixtral": ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
}


def expert_of(name: str) -> tuple[str, int] | None:
    """``(stacked name, expert)`` of one expert's megatron tensor (``decoder.layers.3.mlp.experts.
    local_experts.5.linear_fc1.weight``, numbered in the layer) -> ``(decoder.layers.3.mlp.experts.
    linear_fc1.weight, 5)``; None for any other tensor."""
    m = _EXPERT.match(name)
    return None if m is None else (m.group(1) + m.group(3), int(m.group(2)))


def one_expert(stacked: str, expert: int) -> str:
    """The megatron name of expert ``expert``'s tensor in the stacked tensor ``stacked``."""
    return stacked.replace("mlp.experts.", f"mlp.experts.local_experts.{expert}.", 1)


def checkpoint_names(arch: Architecture, hf_name: str, expert: int | None = None) -> list[str]:
    """The tensors a checkpoint stores for the in-memory Hugging Face tensor ``hf_name`` (with
    ``expert``, for that expert's slice of a packed experts tensor, concatenated in order):
    itself, but for a mixture of experts' routers and experts, which checkpoints keep per
    expert under the family's names (:data:`CHECKPOINT_EXPERTS`)."""
    m = re.match(r"^(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.(gate_up_proj|down_proj))$", hf_name)
    if m is None or not arch.is_moe:
        return [hf_name]
    module, (gate, up, down) = CHECKPOINT_EXPERTS[arch.model_type]
    prefix = m.group(1) + module
    if m.group(3) is None:
        return [f"{prefix}.gate.weight"]
    if expert is None:
        raise ValueError(f"'{hf_name}' is stored per expert: name the expert")
    projections = (gate, up) if m.group(3) == "gate_up_proj" else (down,)
    return [f"{prefix}.experts.{expert}.{x}.weight" for x in projections]


#: Megatron name (inside ``decoder.layers.<i>.``) of each per-layer Hugging Face tensor of
#: Qwen 3's query and key norms.
QK_NORM_NAMES = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def hf_names(arch: Architecture) -> list[str]:
    """Every Hugging Face tensor name of the model, in the order of its state dict."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        if arch.qkv_bias:
            attn = [n for x in "qkv" for n in (f"{p}self_attn.{x}_proj.weight", f"{p}self_attn.{x}_proj.bias")]
        names += attn + [f"{p}self_attn.o_proj.weight"]
        if arch.qk_norm:
            names += [p + name for name in QK_NORM_NAMES]
        if arch.has_experts(i):
            names += [p + name for name in _EXPERT_ORDER[arch.model_type]]
        else:
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


# ---------------------------------------------------------------------------- whole tensors


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if rows > t.shape[0] else t


def _fuse_qkv(arch: Architecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q; k; v] rows regrouped per key/value head: (its query heads, its key, its value)."""
    groups, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, (arch.num_heads // groups) * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(arch: Architecture, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def megatron_names(arch: Architecture, *, fused_norms: bool = False) -> list[str]:
    """Every megatron tensor name of the whole model (global layer numbers; a layer's experts
    stacked); a tied model lists ``output_layer.weight`` too (a copy on the last pipeline stage)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        experts = arch.has_experts(i)
        per_layer = [*layer_names(fused_norms, experts=experts).values(), "self_attention.linear_qkv.weight"]
        if not experts:
            per_layer.append("mlp.linear_fc1.weight")
        if arch.qkv_bias:
            per_layer.append("self_attention.linear_qkv.bias")
        if arch.qk_norm:
            per_layer += QK_NORM_NAMES.values()
        names += [f"decoder.layers.{i}.{n}" for n in per_layer]
    return [*names, "decoder.final_layernorm.weight", "output_layer.weight"]


def hf_sources(arch: Architecture, name: str, *, fused_norms: bool = False) -> list[str]:
    """The Hugging Face tensors megatron tensor ``name`` (global layer number) is made of."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"'{name}' is not a tensor of a converted GPTModel")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest.startswith("self_attention.linear_qkv.") and not rest.endswith("layer_norm_weight"):
        kind = rest.rsplit(".", 1)[1]
        return [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
    experts = arch.has_experts(int(m.group(1)))
    for hf_name, mg_name in {**layer_names(fused_norms, experts=experts), **(QK_NORM_NAMES if arch.qk_norm else {})}.items():
        if rest == mg_name:
            return [p + hf_name]
    raise KeyError(f"'{name}' is not a tensor of a converted GPTModel")


def to_megatron(arch: Architecture, name: str, sources: list[torch.Tensor], *, tp_size: int = 1) -> torch.Tensor:
    """The whole megatron tensor ``name`` from its :func:`hf_sources` tensors, in that
    order (the vocabulary padded to :meth:`Architecture.padded_vocab_size`; a layer's stacked
    experts are the packed tensor as it is)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return _pad_rows(sources[0], arch.padded_vocab_size(tp_size))
    if "linear_qkv." in name and not name.endswith("layer_norm_weight"):
        return _fuse_qkv(arch, *sources)
    if name.endswith("linear_fc1.weight"):
        return torch.cat(sources)
    return sources[0]


def to_hf(arch: Architecture, name: str, whole: torch.Tensor, *, fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors in the whole megatron tensor ``name`` (vocabulary padding
    dropped; nothing for a tied model's ``output_layer.weight``, a copy of the embedding)."""
    sources = hf_sources(arch, name, fused_norms=fused_norms)
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        return {}
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return {sources[0]: whole[:arch.vocab_size]}
    if len(sources) == 3:
        return dict(zip(sources, _split_qkv(arch, whole), strict=True))
    if len(sources) == 2:
        return dict(zip(sources, whole.chunk(2), strict=True))
    return {sources[0]: whole}


def exported_names(arch: Architecture, name: str, *, fused_norms: bool = False) -> list[str]:
    """The Hugging Face tensors :func:`to_hf` returns for megatron tensor ``name``."""
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        return []
    return hf_sources(arch, name, fused_norms=fused_norms)


def hf_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor, in the order of :func:`hf_names`."""
    h, d, f, v = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.vocab_size
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    per_layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate.weight": (arch.num_experts, h),
        "mlp.experts.gate_up_proj": (arch.num_experts, 2 * arch.expert_ffn_hidden_size, h),
        "mlp.experts.down_proj": (arch.num_experts, h, arch.expert_ffn_hidden_size),
    }
    fixed = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return {n: fixed[n] if n in fixed else per_layer[n.split(".", 3)[3]] for n in hf_names(arch)}


def hf_to_megatron(
    arch: Architecture, hf: Mapping[str, torch.Tensor], *, tp_size: int = 1, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """Whole megatron tensors of the whole model from whole Hugging Face tensors."""
    return {
        name: to_megatron(arch, name, [hf[s] for s in hf_sources(arch, name, fused_norms=fused_norms)], tp_size=tp_size)
        for name in megatron_names(arch, fused_norms=fused_norms)
    }


def megatron_to_hf(arch: Architecture, mg: Mapping[str, torch.Tensor], *, fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """Whole Hugging Face tensors, in the order of :func:`hf_names`, from whole megatron
    tensors (the inverse of :func:`hf_to_megatron`)."""
    out: dict[str, torch.Tensor] = {}
    for name, whole in mg.items():
        out.update(to_hf(arch, name, whole, fused_norms=fused_norms))
    order = {name: i for i, name in enumerate(hf_names(arch))}
    return dict(sorted(out.items(), key=lambda item: order[item[0]]))


# ---------------------------------------------------------------------------- tensor parallel


def tp_split_dim(name: str) -> int | None:
    """The dimension megatron splits ``name`` over tensor-parallel ranks (None: replicated).

    Column-parallel layers (vocabulary, fused q/k/v, fused gate/up, an expert's fused gate/up)
    split their output rows; row-parallel layers (attention output, down projections) their
    input columns. Routers are replicated.
    """
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
                      "linear_fc1.weight")):
        return 0
    return None


def _stacked(name: str) -> bool:
    """Whether ``name`` is a layer's experts stacked (each expert split on its own)."""
    return name.endswith(("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"))


def _glu_view(name: str, t: torch.Tensor) -> torch.Tensor | None:
    """``linear_fc1`` as [2, ffn, hidden]: each rank holds its slice of gate and of up."""
    return t.reshape(2, -1, *t.shape[1:]) if name.endswith("linear_fc1.weight") else None


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s slice (of ``size``) of the whole megatron tensor ``full``."""
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return full
    if _stacked(name):
        return torch.stack([tp_shard(one_expert(name, 0), expert, rank, size) for expert in full])
    glu = _glu_view(name, full)
    if glu is not None:
        return glu.chunk(size, dim=1)[rank].reshape(-1, *full.shape[1:])
    return full.chunk(size, dim=dim)[rank]


def tp_merge(name: str, shards: Iterable[torch.Tensor]) -> torch.Tensor:
    """The whole megatron tensor from every tensor-parallel rank's slice, in rank order."""
    shards = list(shards)
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _stacked(name):
        return torch.stack([tp_merge(one_expert(name, 0), [s[e] for s in shards]) for e in range(shards[0].shape[0])])
    if name.endswith("linear_fc1.weight"):
        views = [_glu_view(name, s) for s in shards]
        merged = torch.cat(views, dim=1)
        return merged.reshape(-1, *merged.shape[2:])
    return torch.cat(shards, dim=dim)
