"""Data mixtures: a list of sources under data.train or data.validation, each with its own
weight or count, columns and task; the drawn proportions, exact resume, per-source fields and
the config errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.data import MixedDataset, Share, StatefulDataLoader, dataloader_from_config, encoder_from_config
from posttrain.data.setup import dataset_from_config
from posttrain.errors import CheckpointError, ConfigError, DataError
from posttrain.run.context import run_algorithm
from posttrain.run.environments import environment_names


def prompts(path: Path, n: int, *, task: str | None = "math", key: str = "answer", prefix: str = "") -> str:
    """``n`` prompt rows ``{prefix}{i}+1=`` answered ``i+1`` under ``key``; with ``task`` when set."""
    with path.open("w") as f:
        for i in range(n):
            row = {"messages": [{"role": "user", "content": f"{prefix}{i}+1="}], key: str(i + 1)}
            f.write(json.dumps({**row, **({"task": task} if task else {})}) + "\n")
    return path.name


def config_of(folder: Path, model: str, data: str, overrides: list[str] = ()):
    (folder / "exp.yaml").write_text(
        f"run_dir: run\npolicy:\n  model: {model}\n  train_global_batch_size: 8\ndata:\n{data}"
        "environments:\n  math: {}\ngrpo: {num_prompts_per_step: 2, num_generations_per_prompt: 4}\n"
    )
    return load_config("exp.yaml", ["algorithm=grpo", *overrides])


@pytest.fixture
def three_sources(tmp_path, monkeypatch, tiny_model_path):
    """A train mixture of 50, 30 and 20 prompts (tags a, b, c), with shares written ``"weight: 5|-|count: 3"``."""
    monkeypatch.chdir(tmp_path)

    def build(shares: str) -> MixedDataset:
        for tag, n in (("a", 50), ("b", 30), ("c", 20)):
            prompts(tmp_path / f"{tag}.jsonl", n, prefix=tag)
        weights = dict(zip("abc", shares.split("|"), strict=True))
        items = "".join(f"  - {{path: {tag}.jsonl{', ' + weights[tag] if weights[tag] != '-' else ''}}}\n" for tag in "abc")
        config = config_of(tmp_path, tiny_model_path, "  train:\n" + items)
        return dataset_from_config(config, "train", "prompt", encoder_from_config(config))

    return build


def test_weighted_draws_match_the_weights_over_a_long_draw(three_sources):
    mixture = three_sources("weight: 5|weight: 3|weight: 2")
    assert mixture.sizes == [50, 30, 20] and mixture.epoch_size() == 100
    drawn = Counter()
    for epoch in range(400):  # 40,000 samples
        order = mixture.epoch_order(0, epoch, True, first_batch=10 * epoch, batch_size=10)
        assert len(order) == 100
        drawn.update(mixture.locate(i)[0] for i in order)
    total = sum(drawn.values())
    for source, p in enumerate((0.5, 0.3, 0.2)):  # 5 standard errors: at most 0.0125 here
        bound = 5 * (p * (1 - p) / total) ** 0.5
        assert abs(drawn[source] / total - p) < bound, (source, drawn[source] / total, p)


def test_counts_are_exact_per_epoch_and_unweighted_sources_give_every_row_once(three_sources):
    mixture = three_sources("count: 120|-|weight: 1")  # a repeats rows; b: every row once; c: 20 weighted slots
    loader = StatefulDataLoader(mixture, batch_size=10, seed=3)
    assert len(loader) == (120 + 30 + 20) // 10
    for epoch in range(2):
        order = loader.order(epoch)
        sources = Counter(mixture.locate(i)[0] for i in order)
        assert sources == {0: 120, 1: 30, 2: 20}
        rows_of_a = Counter(mixture.locate(i)[1] for i in order if mixture.locate(i)[0] == 0)
        assert set(rows_of_a.values()) <= {2, 3} and len(rows_of_a) == 50  # 120 = 2 full passes + 20 of a third
        assert sorted(i for i in order if mixture.locate(i)[0] == 1) == list(range(50, 80))
    assert loader.order(0) != loader.order(1)
    batch = mixture.collate(loader.order(0)[:10])  # a batch names each sample's source and row
    for tag, origin, messages in zip(batch["source"], batch["origin"], batch["messages"], strict=True):
        row = int(origin.rsplit(" ", 1)[1])
        assert origin.startswith(f"{tag}.jsonl row ") and messages[0]["content"] == f"{tag}{row - 1}+1="


def test_a_restored_loader_continues_mid_epoch_with_the_same_samples(three_sources):
    mixture = three_sources("weight: 5|weight: 3|count: 7")
    run = StatefulDataLoader(mixture, batch_size=8, seed=1)
    stream = iter(run)
    for _ in range(4):
        next(stream)
    saved = run.state_dict()
    expected = [batch["origin"] for batch in stream]  # the rest of epoch 0
    expected += [batch["origin"] for batch in run]  # and epoch 1

    resumed = StatefulDataLoader(mixture, batch_size=8, seed=1)
    resumed.load_state_dict(saved)
    found = [batch["origin"] for batch in resumed] + [batch["origin"] for batch in resumed]
    assert found == expected and len(expected) == 2 * len(run) - 4

    reweighted = three_sources("weight: 5|weight: 2|count: 7")
    with pytest.raises(CheckpointError, match=r"mixture \[\['a', 50, 5.0, None, \[\]\], \['b', 30, 3.0, None, \[\]\]"):
        StatefulDataLoader(reweighted, batch_size=8, seed=1).load_state_dict(saved)


def test_a_weight_schedule_moves_the_draws_batch_by_batch(three_sources):
    """a's weight falls linearly from 1 at batch 0 to 0 at batch 5, b keeps 1: from batch 5 on
    no sample of a is drawn, in this epoch or the next; c's 20 rows come once each epoch."""
    mixture = three_sources("weight_schedule: [[0, 1.0], [5, 0.0]]|weight: 1|-")
    assert [mixture.shares[0].weight_at(b) for b in (0, 2.5, 5, 50)] == [1.0, 0.5, 0.0, 0.0]
    loader = StatefulDataLoader(mixture, batch_size=10, seed=2)
    assert len(loader) == 10  # (50 + 30 weighted + 20) / 10
    per_batch = [Counter(batch["source"]) for _ in range(2) for batch in loader]
    assert sum(counts["a"] for counts in per_batch[:5]) > 0
    assert all(counts["a"] == 0 for counts in per_batch[5:]), per_batch
    for epoch in range(2):
        assert sum(counts["c"] for counts in per_batch[10 * epoch:10 * (epoch + 1)]) == 20


def test_each_source_has_its_own_columns_and_task(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.chdir(tmp_path)
    prompts(tmp_path / "sums.jsonl", 6, task=None)
    prompts(tmp_path / "other.jsonl", 4, task=None, key="solution", prefix="x")
    config = config_of(tmp_path, tiny_model_path, "  train:\n    - {path: sums.jsonl, task: math, tag: sums}\n"
                       "    - {path: other.jsonl, task: math, columns: {solution: answer}}\n")
    mixture = dataset_from_config(config, "train", "prompt", encoder_from_config(config))
    assert [share.tag for share in mixture.shares] == ["sums", "other"]
    batch = mixture.collate(range(10))
    assert batch["task"] == ["math"] * 10 and batch["source"] == ["sums"] * 6 + ["other"] * 4
    assert batch["answer"] == [str(i + 1) for i in range(6)] + [str(i + 1) for i in range(4)]
    assert len(dataloader_from_config(config, mixture, 2)) == 5


def test_a_validation_mixture_reads_every_row_of_every_source_once_in_order(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.chdir(tmp_path)
    prompts(tmp_path / "a.jsonl", 3)
    prompts(tmp_path / "b.jsonl", 2, prefix="b")
    config = config_of(tmp_path, tiny_model_path, "  train: a.jsonl\n  validation: [a.jsonl, b.jsonl]\n")
    val = dataset_from_config(config, "validation", "prompt", encoder_from_config(config))
    loader = dataloader_from_config(config, val, 2, train=False)
    assert [origin for batch in loader for origin in batch["origin"]] == [
        "a.jsonl row 1", "a.jsonl row 2", "a.jsonl row 3", "b.jsonl row 1", "b.jsonl row 2"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("  train:\n    - {path: a.jsonl, weight: 0}\n    - {path: b.jsonl, weight: 0.0}\n",
         "the weights of the mixture's sources (a, b) sum to 0; give at least one of them a weight above 0"),
        ("  train:\n    - {path: a.jsonl, weight: -1}\n",
         "config key 'data.train[0]' (at exp.yaml:6): weight must be a finite number >= 0 (a sampling probability, "
         "normalised over the weighted sources), found -1.0"),
        ("  train:\n    - {path: a.jsonl, weight: 1, count: 3}\n",
         "config key 'data.train[0]' (at exp.yaml:6): set weight or count, not both (found weight 1 and count 3)"),
        ("  train:\n    - a.jsonl\n    - {path: sub/a.jsonl}\n",
         "data.train[0] and data.train[1] are both named 'a' in metrics; set a distinct tag on one of them "
         "(data.train[1].tag) Where set: data.train at exp.yaml:6."),
        ("  train: a.jsonl\n  validation:\n    - {path: a.jsonl, weight: 2}\n",
         "data.validation[0].weight: validation reads every row of every source once; weights and counts apply to "
         "data.train. Remove it."),
        ("  train: []\n", "data.train is an empty list; name at least one dataset Where set: data.train at exp.yaml:6."),
        ("  train:\n    - {path: a.jsonl, weight_schedule: [[0, 1.0], [10, 0.0]]}\n    - {path: b.jsonl, weight: 0}\n",
         "the weights of the mixture's sources (a, b) sum to 0 at batch 10; give at least one of them a weight above 0"),
        ("  train:\n    - {path: a.jsonl, weight_schedule: [[5, 1.0]]}\n",
         "config key 'data.train[0]' (at exp.yaml:6): weight_schedule's batches must be whole numbers ascending from 0, "
         "e.g. [[0, 1.0], [200, 3.0]]; found [5.0]"),
    ],
    ids=["weights-sum-to-zero", "negative-weight", "weight-and-count", "same-tag", "weighted-validation", "empty",
         "schedule-sums-to-zero", "schedule-not-from-0"],
)
def test_a_mixture_config_error_names_the_key_and_the_fix(tmp_path, monkeypatch, tiny_model_path, data, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    for path in ("a.jsonl", "b.jsonl", "sub/a.jsonl"):
        prompts(tmp_path / path, 4)
    with pytest.raises(ConfigError) as info:
        config = config_of(tmp_path, tiny_model_path, data)
        dataset_from_config(config, "train", "prompt", encoder_from_config(config))
        dataset_from_config(config, "validation", "prompt", encoder_from_config(config))
    assert str(info.value) == message


def test_a_source_without_what_its_environment_needs_is_named_before_ray(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.chdir(tmp_path)
    prompts(tmp_path / "sums.jsonl", 4)
    prompts(tmp_path / "words.jsonl", 4, task=None, key="reference", prefix="w")  # no 'answer' for math
    config = config_of(tmp_path, tiny_model_path, "  train:\n    - sums.jsonl\n    - {path: words.jsonl, task: math}\n")
    with pytest.raises(DataError) as info:
        run_algorithm(config)
    assert str(info.value) == (
        "data.train[1] (words.jsonl) row 1: the math environment needs 'answer' (the ground truth the final answer is "
        "compared with) in each of its rows, and this row has none (its metadata keys: reference); 3 more rows lack "
        "what their environment needs: 2, 3, 4. Add the keys to these rows (as keys of the row, or under its "
        "'metadata'), remove them, or set data.skip_malformed: true to leave such rows out.")

    prompts(tmp_path / "words.jsonl", 4, task=None, prefix="w")  # with the answers: every source names its task
    mixture = dataset_from_config(config, "train", "prompt", encoder_from_config(config))
    assert environment_names(config, [mixture]) == (["math"], None)


def test_shares_are_checked_against_the_sources():
    with pytest.raises(ValueError, match="a mixture needs one share per source, got 0 sources and 1 shares"):
        MixedDataset([], [Share("a")])


def test_an_sft_mixture_collates_conversations_of_every_source(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.chdir(tmp_path)
    for name, count in (("short", 3), ("long", 5)):
        rows = [{"messages": [{"role": "user", "content": f"{name} {i}"}, {"role": "assistant", "content": "ok" * (i + 1)}]}
                for i in range(count)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = config_of(tmp_path, tiny_model_path, "  train:\n    - {path: short.jsonl, count: 6}\n    - long.jsonl\n")
    mixture = dataset_from_config(config, "train", "sft", encoder_from_config(config))
    loader = dataloader_from_config(config, mixture, 11)
    (batch,) = list(loader)  # 6 + 5 samples: one batch per epoch
    assert batch["input_ids"].shape[0] == 11 and batch["token_mask"].sum() > 0
    assert "source" not in batch  # per-source metrics are a rollout's; SFT batches hold tensors only
    counts = Counter(mixture.locate(i)[0] for i in loader.order(0))
    assert counts == {0: 6, 1: 5}
