"""Model-folder checks: each broken folder fails with its exact message, on the driver,
before Ray or any worker starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain.models.folder import check_model_folders

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model(tiny_model_path, tmp_path) -> Path:
    """A private copy of the tiny model folder, free to break."""
    return Path(shutil.copytree(tiny_model_path, tmp_path / "model"))


def sft_config(model: Path | str, **policy):
    return config_from_dict({
        "algorithm": "sft",
        "policy": {"model": str(model), **policy},
        "data": {"train": str(REPO / "examples/data/sft_train.jsonl")},
    })


def edit_json(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_the_tiny_model_passes(model):
    check_model_folders(sft_config(model))


def test_a_missing_folder(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(tmp_path / "nowhere"))
    assert str(err.value) == (
        f"policy.model: '{tmp_path / 'nowhere'}' is not a folder; set policy.model to a local Hugging Face model folder"
    )


def test_a_folder_without_config_json(model):
    (model / "config.json").unlink()
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(model))
    assert str(err.value) == (
        f"policy.model: the model folder '{model}' has no config.json; save the model with save_pretrained() "
        "or point the key at the folder that holds config.json"
    )


def test_a_folder_without_weights(model):
    (model / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(model))
    assert str(err.value) == (
        f"policy.model: the model folder '{model}' has no weights; expected one of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json (or *.safetensors shards). "
        "Save the model with save_pretrained() into this folder"
    )


def test_an_index_listing_a_missing_shard(model):
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(model))
    assert str(err.value) == (
        f"policy.model: {model / 'model.safetensors.index.json'} lists 2 weight shards, but 1 are missing: "
        "model-00002-of-00002.safetensors. Copy the whole model folder"
    )


def test_a_folder_without_tokenizer_files(model, tmp_path):
    weights_only = Path(shutil.copytree(model, tmp_path / "weights_only"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights_only / name).unlink()
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(weights_only))
    assert str(err.value) == (
        f"policy.model: the folder '{weights_only}' has no tokenizer files; expected one of tokenizer.json, "
        "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt. Save the tokenizer with save_pretrained() "
        "there, or set policy.tokenizer to its folder"
    )
    check_model_folders(sft_config(weights_only, tokenizer=str(model)))  # a separate tokenizer folder fixes it


def test_a_tokenizer_larger_than_the_embedding(model):
    edit_json(model / "config.json", vocab_size=100)  # the character tokenizer has 103 tokens
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(model))
    assert str(err.value) == (
        f"policy.model: the tokenizer '{model}' has 103 tokens, but the model '{model}' has 100 embedding rows "
        "(vocab_size in config.json); ids 100 to 102 would index past the embedding. Use the tokenizer the model "
        "was trained with, or resize the model's embeddings (resize_token_embeddings) and save it"
    )


@pytest.mark.parametrize("name", ["pad", "eos", "bos"])
def test_special_ids_past_the_embedding(model, name):
    edit_json(model / "config.json", **{f"{name}_token_id": 103})
    with pytest.raises(ConfigError) as err:
        check_model_folders(sft_config(model))
    tokenizer_id = {"pad": 0, "bos": 1, "eos": 2}[name]
    assert str(err.value) == (
        f"policy.model: config.json of '{model}' sets {name}_token_id 103, but the model has 103 embedding rows "
        f"(vocab_size), so id 103 has no embedding. Set {name}_token_id in config.json to the tokenizer's id "
        f"({tokenizer_id})"
    )


def test_the_cli_refuses_before_ray_starts(model, monkeypatch, capsys):
    import posttrain.distributed.cluster as cluster

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the model folder was checked")

    monkeypatch.setattr(cluster, "init_ray", no_ray)
    monkeypatch.chdir(REPO)
    edit_json(model / "config.json", vocab_size=100)
    code = cli.main([
        "run", "sft", "--config", "examples/configs/sft.yaml", f"policy.model={model}",
        f"run_dir={model.parent / 'run'}", "logger.progress_bar=false",
    ])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"error: policy.model: the tokenizer '{model}' has 103 tokens")
