"""Tiny random checkpoints of the architectures users bring, for tests and benchmarks.

Each entry of :data:`ARCHITECTURES` builds a model with transformers' own config class,
2 layers, hidden size 64 and heads of 32 (vLLM's CPU attention refuses smaller ones), and
keeps what makes its family distinctive: Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma's
scaled and tied embeddings, soft-capping and sliding windows, Mistral's sliding window,
Phi-3's fused projections, OLMo 2's norm placement, Llama 3's rope scaling, the experts of
Qwen3-MoE and Mixtral. A distinctive feature is sized to change the numbers at this size:
windows of :data:`WINDOW` tokens, soft-caps of 5, weights drawn with a standard deviation
of :data:`INIT_STD` (transformers' default of 0.02 leaves a tiny model's logits so flat that
a soft-cap of 30 moves its loss by less than 1e-6). A test that ignores a feature then gets
numbers that differ from transformers'.

Each architecture comes with its family's tokenizer (:data:`CHAT_FORMATS`): a byte-level BPE
learned locally with the family's special tokens and chat template
(:mod:`posttrain.testing.chat_formats`), the embedding rounded up to a multiple of
:data:`VOCAB_MULTIPLE` rows as released checkpoints do (Qwen's 151,936 rows hold 151,665
tokens). ``tokenizer="character"`` gives the character-level tokenizer of
:mod:`posttrain.models.tiny` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: Sliding-window width, in tokens, of every windowed architecture here.
WINDOW = 8
#: Standard deviation of the random weights (``initializer_range``).
INIT_STD = 0.2
#: The embedding's rows are the tokenizer's size rounded up to a multiple of this.
VOCAB_MULTIPLE = 64

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    initializer_range=INIT_STD,
)
_ALTERNATING = ["sliding_attention", "full_attention"]


def _llama(**kw: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_COMMON, **kw})


def _llama3(**kw: Any):
    from transformers import LlamaConfig

    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    return LlamaConfig(**{**_COMMON, "rope_parameters": rope, **kw})


def _llama_tied(**kw: Any):
    return _llama(**{"tie_word_embeddings": True, **kw})


def _qwen2(**kw: Any):
    from transformers import Qwen2Config

    return Qwen2Config(**{**_COMMON, "tie_word_embeddings": True, **kw})


def _qwen3(**kw: Any):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_COMMON, "head_dim": 32, "tie_word_embeddings": True, **kw})


def _mistral(**kw: Any):
    from transformers import MistralConfig

    return MistralConfig(**{**_COMMON, "head_dim": 32, "sliding_window": WINDOW, **kw})


def _gemma2(**kw: Any):
    from transformers import Gemma2Config

    return Gemma2Config(
        **{
            **_COMMON,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 5.0,
            **kw,
        }
    )


def _gemma3(**kw: Any):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{
            **_COMMON,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            **kw,
        }
    )


def _phi3(**kw: Any):
    from transformers import Phi3Config

    return Phi3Config(**{**_COMMON, **kw})


def _olmo2(**kw: Any):
    from transformers import Olmo2Config

    return Olmo2Config(**{**_COMMON, **kw})


def _qwen3_moe(**kw: Any):
    from transformers import Qwen3MoeConfig

    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    return Qwen3MoeConfig(**{**_COMMON, "head_dim": 32, **experts, **kw})


def _mixtral(**kw: Any):
    from transformers import MixtralConfig

    return MixtralConfig(**{**_COMMON, "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, **kw})


#: Architecture name -> config builder (keyword arguments override single fields).
ARCHITECTURES: dict[str, Callable[..., Any]] = {
    "llama": _llama,
    "llama3": _llama3,
    "llama_tied": _llama_tied,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


#: Architecture name -> the chat format (:data:`posttrain.testing.chat_formats.FORMATS`) of its family.
CHAT_FORMATS: dict[str, str] = {
    "llama": "llama3",
    "llama3": "llama3",
    "llama_tied": "llama3",  # Llama 3.2 1B and 3B tie their embeddings
    "qwen2": "chatml",
    "qwen3": "chatml_generation",
    "mistral": "mistral",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "qwen3_moe": "chatml_generation",
    "mixtral": "mistral",
}
#: ``tokenizer`` values of :func:`zoo_tokenizer`.
TOKENIZERS = ("chat", "character")


def zoo_tokenizer(name: str, tokenizer: str = "chat") -> Any:
    """Architecture ``name``'s tokenizer: its family's BPE and chat format (``chat``) or the
    character-level tokenizer (``character``)."""
    from posttrain.models.tiny import build_tokenizer
    from posttrain.testing.chat_formats import build_chat_tokenizer

    if name not in ARCHITECTURES:
        raise KeyError(f"unknown zoo architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    if tokenizer not in TOKENIZERS:
        raise KeyError(f"unknown zoo tokenizer {tokenizer!r}; known: {', '.join(TOKENIZERS)}")
    return build_chat_tokenizer(CHAT_FORMATS[name]) if tokenizer == "chat" else build_tokenizer()


def _stop_ids(name: str, tokenizer: str, tok: Any) -> list[int]:
    """The ids generation stops at: the family's end-of-turn and end-of-text tokens."""
    from posttrain.testing.chat_formats import FORMATS

    stops = FORMATS[CHAT_FORMATS[name]].stops if tokenizer == "chat" else (tok.eos_token,)
    return [tok.convert_tokens_to_ids(t) for t in stops]


def zoo_config(name: str, *, tokenizer: str = "chat", **overrides: Any):
    """The config of architecture ``name`` sized for its ``tokenizer`` (see :func:`zoo_tokenizer`),
    with its special tokens; ``overrides`` replace single fields."""
    tok = zoo_tokenizer(name, tokenizer)
    ids = dict(
        vocab_size=-(-len(tok) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    config = ARCHITECTURES[name](**{**ids, **overrides})
    config.dtype = torch.float32
    return config


def _seeded_model(config: Any, seed: int) -> Any:
    """A float32 model of ``config`` with weights drawn from ``seed``, the global RNG left as it was."""
    from posttrain.models.auto import generative_class

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return generative_class(config).from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)


def build_zoo_model(path: str | Path, name: str, *, seed: int = 0, tokenizer: str = "chat", **overrides: Any) -> Path:
    """Write a seeded random model of architecture ``name`` and its ``tokenizer`` (see
    :func:`zoo_tokenizer`) to ``path`` as a Hugging Face folder; return it. Its generation
    config stops at the family's end-of-turn and end-of-text tokens. The same arguments give
    the same weights."""
    path = Path(path)
    tok = zoo_tokenizer(name, tokenizer)
    config = zoo_config(name, tokenizer=tokenizer, **overrides)
    model = _seeded_model(config, seed)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = _stop_ids(name, tokenizer, tok)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


# ------------------------------------------------------------------ vision-language models

#: Side, in pixels, of a vision patch; a merged group of 2 x 2 patches is one image token.
PATCH = 14
#: The images the zoo's processors take are resized to at most this many pixels (16 image tokens).
MAX_IMAGE_PIXELS = (4 * PATCH * 2) ** 2
#: Side, in pixels, of an Idefics3 tile: 4 x 4 patches, 2 x 2 image tokens.
TILE = 4 * PATCH


def _token_ids(tok: Any, text: dict[str, Any] | None) -> dict[str, Any]:
    """The language model's vocabulary and special ids for tokenizer ``tok``, then ``text``."""
    return {"vocab_size": -(-len(tok) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **(text or {})}


def _qwen_vl(config_cls: Any, vision: dict[str, Any], tok: Any, text: dict[str, Any] | None):
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = {**_COMMON, "head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [4, 6, 6]}, **_token_ids(tok, text)}
    return config_cls(
        text_config=text, vision_config={"depth": 1, "hidden_size": _COMMON["hidden_size"], "patch_size": PATCH,
                                         "spatial_merge_size": 2, **vision},
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], **{k: text[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")},
    )


def _qwen2_vl(tok: Any, text: dict[str, Any] | None = None):
    from transformers import Qwen2VLConfig

    return _qwen_vl(Qwen2VLConfig, {"embed_dim": 32, "num_heads": 2, "mlp_ratio": 2}, tok, text)


def _qwen2_5_vl(tok: Any, text: dict[str, Any] | None = None):
    from transformers import Qwen2_5_VLConfig

    vision = {"intermediate_size": 64, "num_heads": 2, "out_hidden_size": _COMMON["hidden_size"],
              "window_size": 2 * PATCH * 2, "fullatt_block_indexes": [0], "hidden_size": 32}
    return _qwen_vl(Qwen2_5_VLConfig, vision, tok, text)


def _idefics3(tok: Any, text: dict[str, Any] | None = None):
    """SmolVLM's architecture: a vision tower over tiles of :data:`TILE` pixels whose 4 x 4
    patches the connector shuffles into 2 x 2 tokens, before a Llama."""
    from transformers import Idefics3Config

    text = {"model_type": "llama", **_COMMON, "head_dim": 32, **_token_ids(tok, text)}
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": TILE, "patch_size": PATCH, "initializer_range": INIT_STD}
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, pad_token_id=text["pad_token_id"],
                          image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)


#: Vision-language architecture name -> config builder (given the family's tokenizer and
#: overrides of the language model's config): a vision tower of one block before the language
#: model of :data:`ARCHITECTURES`' size (its tokenizer: :data:`VISION_CHAT_FORMATS`).
VISION_ARCHITECTURES: dict[str, Callable[..., Any]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "idefics3": _idefics3,
}
#: Vision-language architecture name -> its family's chat format (with image parts).
VISION_CHAT_FORMATS: dict[str, str] = {"qwen2_vl": "chatml_vision", "qwen2_5_vl": "chatml_vision", "idefics3": "smolvlm"}


def build_zoo_vlm(path: str | Path, name: str, *, seed: int = 0, text: dict[str, Any] | None = None) -> Path:
    """Write a seeded random vision-language model of architecture ``name``
    (:data:`VISION_ARCHITECTURES`) to ``path`` as a Hugging Face folder with the family's
    tokenizer and chat template and its image processor (:func:`image_processor`); ``text``
    overrides fields of its language model's config. The same arguments give the same weights."""
    from posttrain.testing.chat_formats import FORMATS, build_chat_tokenizer

    if name not in VISION_ARCHITECTURES:
        raise KeyError(f"unknown zoo vision-language architecture {name!r}; known: {', '.join(VISION_ARCHITECTURES)}")
    path = Path(path)
    fmt = VISION_CHAT_FORMATS[name]
    tok = build_chat_tokenizer(fmt)
    config = VISION_ARCHITECTURES[name](tok, text)
    model = _seeded_model(config, seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(t) for t in FORMATS[fmt].stops]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    if config.model_type == "idefics3":
        _idefics3_processor(tok).save_pretrained(path)
    else:
        image_processor(config).save_pretrained(path)
    return path


def _idefics3_processor(tok: Any) -> Any:
    """SmolVLM's processor at the zoo's size: an image resized to at most 2 x 2 tiles of
    :data:`TILE` pixels, each tile and the whole image resized to one tile (a global view) of
    4 image tokens. The PIL image processor (torchvision's needs a CUDA build here)."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    images = Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 2 * TILE},
                                       max_image_size={"longest_edge": TILE})
    return Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=(TILE // PATCH // 2) ** 2)


def image_processor(config: Any) -> Any:
    """The family's image processor for a model ``config``: the PIL one (torchvision's needs a
    CUDA build here), images resized to at most :data:`MAX_IMAGE_PIXELS`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    merge = config.vision_config.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=merge, size={"shortest_edge": (PATCH * merge) ** 2, "longest_edge": MAX_IMAGE_PIXELS},
    )
