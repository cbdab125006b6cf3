"""Data by name: ``save_to_disk`` folders, dataset repository folders and Hub datasets (from
the datasets cache) under ``data.train`` / ``data.validation``, and column renames.

Every dataset is built by the test and nothing is downloaded: the Hub is offline. Rows that
come out are compared with the rows put in, and tokenised batches of renamed columns with
those of a local file written in the native keys.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
import torch

from posttrain.config import config_from_dict, dump_config, load_config
from posttrain.config.schema import DataConfig, DataSource, PolicyConfig, RunConfig
from posttrain.data import ChatEncoder, build_dataset, dataset_from_config, encoder_from_config, open_source
from posttrain.errors import ConfigError, DataError
from posttrain.models.tiny import build_tokenizer

TOKENIZER = build_tokenizer()
QA = [{"question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(4)]
QA_TEST = [{"question": f"{i}*{i}?", "answer": str(i * i)} for i in range(3)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A datasets cache of the test's own, offline (what load_dataset prepares goes here)."""
    folder = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return folder


@pytest.fixture
def encoder() -> ChatEncoder:
    return ChatEncoder(TOKENIZER)


def rows_of(source) -> list[dict]:
    numbered = list(source)
    assert [number for number, _ in numbered] == list(range(1, len(numbered) + 1))
    return [row for _, row in numbered]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def save_dict(folder: Path, **splits: list[dict]) -> Path:
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(folder)
    return folder


def write_repository(folder: Path, subsets: dict[str, dict[str, list[dict]]]) -> Path:
    """A dataset repository as on the Hub: one folder of parquet files per subset, declared
    in the README's configs."""
    card = ["---", "configs:"]
    for subset, splits in subsets.items():
        (folder / subset).mkdir(parents=True)
        card += [f"- config_name: {subset}", "  data_files:"]
        for split, rows in splits.items():
            datasets.Dataset.from_list(rows).to_parquet(folder / subset / f"{split}.parquet")
            card += [f"  - split: {split}", f"    path: {subset}/{split}.parquet"]
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))
    return folder


def batches_equal(a, b) -> bool:
    """Equal fields, except ``origin``: it names each row's source, which differs by design."""
    if set(a) != set(b):
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a if k != "origin")


# ------------------------------------------------------------------ save_to_disk folders


def test_save_to_disk_dataset_dict_by_path_and_split(tmp_path):
    folder = save_dict(tmp_path / "saved", train=QA, test=QA_TEST)
    train = open_source(str(folder), key="data.train")
    assert train.label == f"{folder} (split train)"
    assert train.columns == ("question", "answer")
    assert rows_of(train) == QA
    test = open_source(DataSource(path=str(folder), split="test"), key="data.validation", default_split="validation")
    assert test.label == f"{folder} (split test)" and rows_of(test) == QA_TEST
    single = save_dict(tmp_path / "one", only=QA_TEST)  # a single split needs no choosing
    assert rows_of(open_source(single, key="data.validation", default_split="validation")) == QA_TEST


def test_save_to_disk_single_dataset(tmp_path):
    folder = tmp_path / "single"
    datasets.Dataset.from_list(QA).with_format("torch").save_to_disk(folder)  # rows still come out as Python values
    source = open_source(str(folder))
    assert source.label == str(folder) and rows_of(source) == QA
    with pytest.raises(ConfigError) as info:
        open_source(DataSource(path=str(folder), split="train"), key="data.train")
    assert str(info.value) == (
        f"data.train.split: {folder} holds a single Dataset saved with save_to_disk, which has no splits; remove it"
    )


def test_a_dataset_folder_gives_the_batches_of_the_same_rows_in_a_file(tmp_path, encoder):
    rows = [{"prompt": "1+1", "answer": "2", "task": "math", "level": 1},
            {"prompt": "2+3", "answer": "5", "task": None, "level": 3}]
    from_file = build_dataset(write_jsonl(tmp_path / "d.jsonl", rows), "prompt", encoder)
    from_folder = build_dataset(save_dict(tmp_path / "saved", train=rows), "prompt", encoder)
    assert from_folder.report.source == f"{tmp_path / 'saved'} (split train)"
    assert batches_equal(from_folder.collate([0, 1]), from_file.collate([0, 1]))


def test_missing_split_lists_the_splits(tmp_path):
    folder = save_dict(tmp_path / "saved", train=QA, test=QA_TEST)
    with pytest.raises(ConfigError) as info:
        open_source(DataSource(path=str(folder), split="tset"), key="data.validation", default_split="validation")
    assert str(info.value) == (
        f"data.validation.split: {folder} has no split 'tset'; its splits: train, test. Did you mean 'test'?"
    )
    with pytest.raises(ConfigError) as info:  # no split named like the key: the user chooses
        open_source(str(folder), key="data.validation", default_split="validation")
    assert str(info.value) == (
        f"data.validation: {folder} has splits train, test and none is named 'validation'; "
        f"choose one: data.validation: {{path: {folder}, split: train}}"
    )


# ------------------------------------------------------------------ repositories and the Hub


def test_repository_folder_by_subset_and_split(tmp_path):
    repo = write_repository(tmp_path / "repo", {"main": {"train": QA}, "other": {"train": QA_TEST, "test": QA}})
    source = open_source(DataSource(path=str(repo), subset="other", split="test"), key="data.validation")
    assert source.label == f"{repo} (subset other, split test)" and rows_of(source) == QA
    assert rows_of(open_source(DataSource(path=str(repo), subset="main"), key="data.train")) == QA
    with pytest.raises(ConfigError) as info:
        open_source(DataSource(path=str(repo), subset="nope"), key="data.train")
    assert str(info.value) == f"data.train.subset: {repo} (subset nope): BuilderConfig 'nope' not found. Available: ['main', 'other']"
    with pytest.raises(ConfigError, match=r"^data\.train\.subset: .*repo: Config name is missing\. Please pick one among the available configs: \['main', 'other'\]"):
        open_source(str(repo), key="data.train")


def cache_hub_dataset(tmp_path: Path, cache: Path, repo_id: str, subsets: dict[str, dict[str, list[dict]]]) -> None:
    """Leave ``repo_id`` in the datasets cache as a load_dataset with network access would:
    prepared under ``<cache>/<org>___<name>/<subset>/...`` from the repository's files."""
    org, name = repo_id.split("/")
    repo = write_repository(tmp_path / "hub" / name, subsets)
    for subset in subsets:
        datasets.load_dataset(str(repo), subset)
    (cache / name).rename(cache / f"{org}___{name}")


def test_hub_dataset_from_the_cache_through_the_config(tmp_path, cache):
    cache_hub_dataset(tmp_path, cache, "someorg/math", {"main": {"train": QA, "test": QA_TEST}, "other": {"train": QA}})
    model = tmp_path / "model"  # the tokenizer is all the data needs from the model folder
    TOKENIZER.save_pretrained(model)
    config = config_from_dict({
        "policy": {"model": str(model)},
        "data": {"train": {"name": "someorg/math", "subset": "main"},
                 "validation": {"name": "someorg/math", "subset": "main", "split": "test"}},
    })
    assert config.data.train == DataSource(name="someorg/math", subset="main")
    encoder = encoder_from_config(config)
    train = dataset_from_config(config, "train", "prompt", encoder)
    assert train.report.source == "Hub dataset someorg/math (subset main, split train)"
    assert [m[-1]["content"] for m in train.collate(range(4))["messages"]] == [row["question"] for row in QA]
    validation = dataset_from_config(config, "validation", "sft", encoder)
    assert len(validation) == len(QA_TEST)
    assert rows_of(open_source(DataSource(name="someorg/math", subset="main", split="test"))) == QA_TEST


def test_hub_dataset_not_in_the_cache_fails_at_once_offline(cache):
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        open_source(DataSource(name="someorg/absent", subset="main", split="train", revision="v1"), key="data.train")
    assert time.monotonic() - start < 10
    assert str(info.value) == (
        f"data.train: Hub dataset someorg/absent (subset main, revision v1) is not in the local datasets cache "
        f"({cache}) and offline mode is on (HF_HUB_OFFLINE=1). Load it once with network access (unset "
        "HF_HUB_OFFLINE) to cache it, or download the repository (hf download someorg/absent --repo-type dataset "
        "--local-dir DIR) and set data.train: {path: DIR}"
    )


def test_paths_and_names_that_are_not_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        open_source("someorg/math", key="data.train")
    assert str(info.value) == (
        f"data.train: no such file or folder: {tmp_path}/someorg/math ('someorg/math' is relative: relative data "
        f"paths resolve against the current directory, {tmp_path}, not the config file's folder). "
        "For the Hub dataset 'someorg/math', write data.train: {name: someorg/math}"
    )
    with pytest.raises(DataError) as info:
        open_source("data/train.jsonl", key="data.train", sources={"data.train": "exp.yaml:4"})
    assert str(info.value) == (
        f"data.train (at exp.yaml:4): no such file or folder: {tmp_path}/data/train.jsonl ('data/train.jsonl' is "
        f"relative: relative data paths resolve against the current directory, {tmp_path}, not the config file's "
        "folder). Fix the path, or run from the folder it is relative to"
    )
    with pytest.raises(DataError) as info:
        open_source(DataSource(path=str(tmp_path / "gone")), key="data.validation", sources={"data.validation.path": "b.yaml:9"})
    assert str(info.value) == f"data.validation.path (at b.yaml:9): no such file or folder: {tmp_path}/gone. Fix the path"
    save_dict(tmp_path / "org" / "set", train=QA)
    with pytest.raises(ConfigError) as info:
        open_source(DataSource(name="org/set"), key="data.train")
    assert str(info.value) == (
        "data.train.name: 'org/set' is a local folder, but name is for Hub dataset ids; use data.train.path: org/set"
    )
    with pytest.raises(ConfigError, match=r"^data\.train is empty; set it to a file or folder \(or use name: org/dataset for a Hub dataset\)$"):
        open_source("", key="data.train")  # `data.train=` on the command line
    with pytest.raises(ConfigError, match=r"^data\.train\.path is empty; "):
        open_source(DataSource(path=""), key="data.train")
    write_jsonl(tmp_path / "d.jsonl", QA)
    with pytest.raises(ConfigError) as info:
        open_source(DataSource(path="d.jsonl", split="train"), key="data.train")
    assert str(info.value) == (
        "data.train.split: d.jsonl is a file, which has no splits (split applies to dataset folders and Hub "
        "datasets); remove it"
    )


# ------------------------------------------------------------------ columns

LAYOUTS = [  # (kind, rows as the dataset has them, the same rows in native keys, renames in the config)
    ("sft", [{"question": "2+2?", "answer": "4"}], [{"prompt": "2+2?", "response": "4"}], None),
    ("sft", [{"prompt": "hi", "completion": "yo"}], [{"prompt": "hi", "response": "yo"}], None),
    ("sft", [{"problem": "x", "solution": "y", "id": 3}], [{"prompt": "x", "response": "y", "id": 3}], None),
    ("prompt", [{"question": "1+1", "answer": "2", "level": 1}], [{"prompt": "1+1", "answer": "2", "level": 1}], None),
    ("prompt", [{"problem": "1+1", "answer": "2"}], [{"prompt": "1+1", "answer": "2"}], None),
    ("preference", [{"question": "q", "chosen": "a", "rejected": "b"}],
     [{"prompt": "q", "chosen": "a", "rejected": "b"}], None),
    ("sft", [{"instruction": "i", "output": "o"}], [{"prompt": "i", "response": "o"}],
     {"instruction": "prompt", "output": "response"}),
    ("prompt", [{"q": "1+1", "ref": "2"}], [{"prompt": "1+1", "answer": "2"}], {"q": "prompt", "ref": "answer"}),
    ("preference", [{"context": "q", "good": "a", "bad": "b"}], [{"prompt": "q", "chosen": "a", "rejected": "b"}],
     {"context": "prompt", "good": "chosen", "bad": "rejected"}),
]


@pytest.mark.parametrize("stored", ["save_to_disk", "jsonl"])
@pytest.mark.parametrize(("kind", "rows", "native", "columns"), LAYOUTS)
def test_columns_are_renamed_to_the_native_keys(tmp_path, encoder, stored, kind, rows, native, columns):
    rows, native = rows * 2, native * 2
    path = save_dict(tmp_path / "saved", train=rows) if stored == "save_to_disk" else write_jsonl(tmp_path / "d.jsonl", rows)
    source = open_source(str(path), key="data.train", columns=columns)
    assert rows_of(source) == rows  # renames apply while building, the source is as stored
    renamed = build_dataset(source, kind, encoder)
    expected = build_dataset(write_jsonl(tmp_path / "native.jsonl", native), kind, encoder)
    assert renamed.report.format == expected.report.format
    assert batches_equal(renamed.collate([0, 1]), expected.collate([0, 1]))


def test_a_source_with_its_own_columns_and_data_columns(tmp_path, encoder):
    model = tmp_path / "model"
    TOKENIZER.save_pretrained(model)
    saved = save_dict(tmp_path / "saved", train=[{"q": "a", "r": "b"}] * 2)
    native = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "a", "response": "b"}] * 2)
    config = config_from_dict({
        "policy": {"model": str(model)},
        "data": {"train": {"path": str(saved)}, "validation": str(native), "columns": {"q": "prompt", "r": "response"}},
    })
    train = dataset_from_config(config, "train", "sft", encoder_from_config(config))
    assert batches_equal(train.collate([0]), build_dataset(native, "sft", encoder).collate([0]))
    with pytest.raises(ConfigError) as info:  # data.columns applies to every source
        dataset_from_config(config, "validation", "sft", encoder_from_config(config))
    assert str(info.value) == (
        f"data.columns: {native} has no column 'q'; its columns: prompt, response. (data.columns applies to every "
        "source; renames for data.validation alone go in its own columns)"
    )
    config.data.validation = DataSource(path=str(native), columns={})  # an empty mapping: no renames here
    assert len(dataset_from_config(config, "validation", "sft", encoder_from_config(config))) == 2


@pytest.mark.parametrize(("columns", "message"), [
    ({"questoin": "prompt"}, "data.train.columns: {src} has no column 'questoin'; its columns: question, answer, "
                             "prompt. Did you mean 'question'?"),
    ({"question": "promt"}, "data.train.columns: column 'question' is mapped to 'promt', which no format reads; map "
                            "columns to messages, prompt, response, system, chosen, rejected, answer, task, "
                            "metadata, tools, images. Did you mean 'prompt'?"),
    ({"question": "response", "answer": "response"},
     "data.train.columns: columns 'question' and 'answer' are both mapped to 'response'; map one column to each key"),
    ({"question": "prompt", "answer": "response"},
     "data.train.columns: column 'question' is mapped to 'prompt', but {src} also has a column 'prompt'; map "
     "'prompt' to another key as well, or leave 'question' out"),
])
def test_bad_renames_name_the_key_the_columns_and_what_fits(tmp_path, encoder, columns, message):
    folder = save_dict(tmp_path / "saved", train=[{"question": "q", "answer": "a", "prompt": "p"}])
    source = open_source(DataSource(path=str(folder), columns=columns), key="data.train")
    with pytest.raises(ConfigError) as info:
        build_dataset(source, "sft", encoder)
    assert str(info.value) == message.format(src=f"{folder} (split train)")


def test_an_ambiguous_layout_asks_for_renames(tmp_path, encoder):
    folder = save_dict(tmp_path / "saved", train=[{"problem": "p", "solution": "s", "answer": "a"}])
    with pytest.raises(ConfigError) as info:
        build_dataset(open_source(folder, key="data.train"), "sft", encoder)
    assert str(info.value) == (
        f"data.train: {folder} (split train) has columns 'answer' and 'solution', each of which could be the "
        "response; choose with data.columns, e.g. {problem: prompt, answer: response}"
    )
    assert len(build_dataset(open_source(folder, key="data.train"), "prompt", encoder)) == 1  # prompt data: answer is its own


def test_unrecognised_columns_say_how_to_rename(tmp_path, encoder):
    folder = save_dict(tmp_path / "saved", train=[{"text": "t"}])
    with pytest.raises(DataError) as info:
        build_dataset(open_source(folder, key="data.train"), "sft", encoder)
    assert str(info.value) == (
        f"{folder} (split train) row 1: cannot tell the row format from its keys ['text']; sft data needs "
        "conversations ('messages' ending with an assistant turn) or 'prompt' + 'response' rows (or set "
        "data.format, or rename columns to these keys with data.columns)"
    )


# ------------------------------------------------------------------ the config forms


def test_config_forms_structure_and_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(
        "data:\n"
        "  train: {name: openai/gsm8k, subset: main, split: train, revision: refs/convert/parquet}\n"
        "  validation: data/saved\n"
        "  columns: {question: prompt, answer: answer}\n"
    )
    config = load_config("run.yaml")
    assert config.data == DataConfig(
        train=DataSource(name="openai/gsm8k", subset="main", split="train", revision="refs/convert/parquet"),
        validation="data/saved",
        columns={"question": "prompt", "answer": "answer"},
    )
    (tmp_path / "dumped.yaml").write_text(dump_config(config))
    assert load_config("dumped.yaml").data == config.data
    override = load_config("run.yaml", ["data.validation={path: data/saved, split: test, columns: {}}"]).data.validation
    assert override == DataSource(path="data/saved", split="test", columns={})


@pytest.mark.parametrize(("train", "message"), [
    ({"name": "org/x", "path": "x"}, "config key 'data.train' (at run.yaml:2): set exactly one of name (a Hub dataset "
                                     "id, e.g. org/dataset) and path (a local file or folder), found both"),
    ({"split": "train"}, "config key 'data.train' (at run.yaml:2): set exactly one of name (a Hub dataset id, e.g. "
                         "org/dataset) and path (a local file or folder), found neither"),
    ({"path": "x", "revision": "v1"}, "config key 'data.train' (at run.yaml:2): revision applies to a Hub dataset "
                                      "(name), not to a local path"),
    ({"name": "org/x", "splt": "train"}, "unknown config key 'data.train.splt' (at run.yaml:2). "
                                         "Did you mean 'data.train.split'?"),
    (3, "config key 'data.train' (at run.yaml:2): expected str or mapping (DataSource) or list[str or mapping (DataSource)] or null, found int 3"),
])
def test_config_errors_name_the_key(tmp_path, monkeypatch, train, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(f"data:\n  train: {json.dumps(train)}\n")
    with pytest.raises(ConfigError) as info:
        load_config("run.yaml")
    assert str(info.value) == message


def test_run_config_with_a_saved_folder_builds_like_a_file(tmp_path, encoder):
    model = tmp_path / "model"
    TOKENIZER.save_pretrained(model)
    rows = [{"prompt": f"p{i}", "response": "r"} for i in range(4)]
    folder = save_dict(tmp_path / "saved", train=rows, validation=rows[:2])
    config = RunConfig(policy=PolicyConfig(model=str(model)), data=DataConfig(train=str(folder), validation=str(folder)))
    train = dataset_from_config(config, "train", "sft", encoder)
    validation = dataset_from_config(config, "validation", "sft", encoder)
    assert (len(train), len(validation)) == (4, 2)
    from_file = build_dataset(write_jsonl(tmp_path / "d.jsonl", rows), "sft", encoder)
    assert batches_equal(train.collate([0, 1, 2, 3]), from_file.collate([0, 1, 2, 3]))
