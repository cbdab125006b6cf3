"""Checks on the model folders a config names, run on the driver before any worker starts.

A Hugging Face folder needs ``config.json``, weights (``*.safetensors`` or
``pytorch_model*.bin``, every shard an index lists) and a tokenizer; the tokenizer's ids
(its length) and the pad, eos and bos ids of ``config.json`` must index rows of the
model's embedding (``vocab_size`` in ``config.json``). Each problem is a :class:`ConfigError` naming the
config key, the folder, what was expected, what was found, and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.config.schema import RunConfig
from posttrain.errors import ConfigError
from posttrain.models.auto import is_vision_language

#: Single-file and index names of Hugging Face weights, in the order transformers prefers them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: Any one of these makes a folder loadable by ``AutoTokenizer``.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_folders(config: RunConfig) -> None:
    """Check ``policy.model`` (with ``policy.tokenizer``) and ``generation.model`` when set."""
    model_key = "policy.model"
    tokenizer_key = "policy.tokenizer" if config.policy.tokenizer else "policy.model"
    model_config = read_model_config(config.policy.model, model_key)
    require_weights(config.policy.model, model_key)
    tokenizer_path = config.policy.tokenizer or config.policy.model
    require_tokenizer_files(tokenizer_path, tokenizer_key)
    check_vocab_fits(model_config, config.policy.model, model_key, tokenizer_path, tokenizer_key)
    moe = config.policy.moe
    asks = [(key, what) for asked, key, what in (
        (moe.routes_key is not None, moe.routes_key, "asks for the experts each token was routed to"),
        (moe.router_losses, moe.router_losses_key, "weighs a loss of the routers"),
        (moe.expert_parallel_size > 1, "policy.moe.expert_parallel_size", "splits the experts over ranks"),
    ) if asked]
    if asks and not is_mixture_of_experts(model_config):
        key, what = asks[0]
        raise ConfigError(
            f"{key} {what}, but {model_key} '{config.policy.model}' "
            f"({model_config.get('model_type', 'no model_type')}) is not a mixture of experts: its config.json "
            f"gives none of {', '.join(EXPERT_COUNT_KEYS)}. Set {key} to its default for a dense model"
        )
    if config.policy.freeze_vision_tower and not is_vision_language(model_config):
        raise ConfigError(
            f"policy.freeze_vision_tower is true, but {model_key} '{config.policy.model}' "
            f"({model_config.get('model_type', 'no model_type')}) has no vision tower: its config.json has no "
            "vision_config. Leave policy.freeze_vision_tower false for a text-only model"
        )
    generation_model = config.generation.model
    if generation_model and generation_model != config.policy.model:
        generation_config = read_model_config(generation_model, "generation.model")
        require_weights(generation_model, "generation.model")
        check_vocab_fits(generation_config, generation_model, "generation.model", tokenizer_path, tokenizer_key)


#: The names transformers' configs give the count of routed experts of a mixture of experts.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_mixture_of_experts(model_config: dict[str, Any]) -> bool:
    """Whether a model folder's ``config.json`` (its text model's, for a multimodal one)
    describes a mixture of experts: a positive count under one of :data:`EXPERT_COUNT_KEYS`."""
    text = model_config.get("text_config") or model_config
    return any(isinstance(text.get(name), int) and text[name] > 0 for name in EXPERT_COUNT_KEYS)


def read_model_config(path: str, key: str) -> dict[str, Any]:
    """The parsed ``config.json`` of the model folder ``path`` (set by config ``key``)."""
    if not path:
        raise ConfigError(f"{key} is empty; set it to a local Hugging Face model folder")
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}: '{path}' is not a folder; set {key} to a local Hugging Face model folder")
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(
            f"{key}: the model folder '{path}' has no config.json; save the model with "
            "save_pretrained() or point the key at the folder that holds config.json"
        )
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: {file} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {file} holds a {type(data).__name__}, expected a JSON object")
    return data


def require_weights(path: str, key: str) -> None:
    """Refuse a model folder without weights, or whose weight index lists a missing shard."""
    folder = Path(path)
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present and not any(folder.glob("*.safetensors")):
        raise ConfigError(
            f"{key}: the model folder '{path}' has no weights; expected one of {', '.join(WEIGHT_FILES)} "
            "(or *.safetensors shards). Save the model with save_pretrained() into this folder"
        )
    for index in (name for name in present if name.endswith(".index.json")):
        shards = sorted(set(json.loads((folder / index).read_text(encoding="utf-8")).get("weight_map", {}).values()))
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise ConfigError(
                f"{key}: {folder / index} lists {len(shards)} weight shards, but {len(missing)} are missing: "
                f"{', '.join(missing)}. Copy the whole model folder"
            )


def require_tokenizer_files(path: str, key: str) -> None:
    """Refuse a tokenizer folder that holds none of :data:`TOKENIZER_FILES`."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}: '{path}' is not a folder; set {key} to a local tokenizer folder")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{key}: the folder '{path}' has no tokenizer files; expected one of {', '.join(TOKENIZER_FILES)}. "
            "Save the tokenizer with save_pretrained() there, or set policy.tokenizer to its folder"
        )


def embedding_rows(model_config: dict[str, Any]) -> int | None:
    """``vocab_size`` of ``config.json`` (or of its ``text_config``), or None when absent."""
    for node in (model_config, model_config.get("text_config") or {}):
        if isinstance(node.get("vocab_size"), int):
            return int(node["vocab_size"])
    return None


def check_vocab_fits(
    model_config: dict[str, Any], model_path: str, model_key: str, tokenizer_path: str, tokenizer_key: str
) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows, and a pad, eos
    or bos id in ``config.json`` that lies past them."""
    rows = embedding_rows(model_config)
    if rows is None:
        return
    from posttrain.data.chat import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    where = f"the model '{model_path}' has {rows} embedding rows (vocab_size in config.json)"
    if len(tokenizer) > rows:
        raise ConfigError(
            f"{tokenizer_key}: the tokenizer '{tokenizer_path}' has {len(tokenizer)} tokens, but {where}; ids "
            f"{rows} to {len(tokenizer) - 1} would index past the embedding. Use the tokenizer the model was "
            "trained with, or resize the model's embeddings (resize_token_embeddings) and save it"
        )
    for name in ("pad", "eos", "bos"):
        ids = model_config.get(f"{name}_token_id")
        for token_id in ids if isinstance(ids, list) else [ids]:
            if isinstance(token_id, int) and not 0 <= token_id < rows:
                raise ConfigError(
                    f"{model_key}: config.json of '{model_path}' sets {name}_token_id {token_id}, but the model "
                    f"has {rows} embedding rows (vocab_size), so id {token_id} has no embedding. Set "
                    f"{name}_token_id in config.json to the tokenizer's id ({getattr(tokenizer, f'{name}_token_id', None)})"
                )
