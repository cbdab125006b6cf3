"""Which transformers auto class builds a model folder's generative model.

A causal LM loads with ``AutoModelForCausalLM``. A vision-language model (its config has a
``vision_config``: Qwen2-VL, Qwen2.5-VL, Idefics3, Gemma 3, ...) loads with
``AutoModelForImageTextToText``: the vision tower, the language model and its head, under
the names its checkpoint uses. Both give the output embedding (``get_output_embeddings``)
and a ``base_model`` whose forward returns the final hidden states.
"""

from __future__ import annotations

from typing import Any


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` (a ``PretrainedConfig`` or a parsed ``config.json``) describes a
    vision-language model: one with a ``vision_config``."""
    found = config.get("vision_config") if isinstance(config, dict) else getattr(config, "vision_config", None)
    return found is not None


def attention_implementation(config: Any, language_model: Any, vision_tower: str) -> Any:
    """What ``from_pretrained(attn_implementation=...)`` takes to run ``language_model`` (a
    kernel name or function) as the attention of ``config``'s language model: the name itself
    for a causal LM; for a vision-language model, a mapping by sub-config that gives the vision
    tower (and the top level) ``vision_tower`` instead, since a kernel written for the decoder
    (packed segments, a shared cache) does not fit the tower's attention over image patches."""
    if not is_vision_language(config):
        return language_model
    return {"text_config": language_model, "vision_config": vision_tower, "": vision_tower}


def generative_class(config: Any) -> Any:
    """The auto class for the generative model of ``config`` (a ``PretrainedConfig``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def vision_tower(model: Any) -> list[Any]:
    """The vision tower of a transformers vision-language ``model`` (with the merger that
    projects its features into the language model: Qwen-VL's ``visual``, LLaVA-style
    ``vision_tower`` and ``multi_modal_projector``, Idefics3's ``vision_model`` and
    ``connector``), as a list of modules; empty for a causal LM."""
    base = model.base_model
    names = ("visual", "vision_tower", "multi_modal_projector", "vision_model", "connector")
    return [m for name in names if (m := getattr(base, name, None)) is not None]
