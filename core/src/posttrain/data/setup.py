"""Build the data pieces of a run from its config (``data`` and ``policy`` sections)."""

from __future__ import annotations

from posttrain.config.schema import RunConfig
from posttrain.data.chat import ChatEncoder, load_tokenizer, read_chat_template
from posttrain.data.dataset import TokenizedDataset, build_dataset
from posttrain.data.lengths import check_lengths
from posttrain.data.loader import StatefulDataLoader
from posttrain.data.sources import open_source
from posttrain.errors import ConfigError


def encoder_from_config(config: RunConfig) -> ChatEncoder:
    """The chat encoder of the policy's tokenizer, with ``data.chat_template`` when set."""
    tokenizer = load_tokenizer(config.policy.tokenizer or config.policy.model)
    value = config.data.chat_template
    template = read_chat_template(value) if value else None
    source = f"data.chat_template ('{value}')" if value and "{" not in value else "data.chat_template"
    return ChatEncoder(tokenizer, template, source=source)


def dataset_from_config(
    config: RunConfig, split: str, kind: str, encoder: ChatEncoder, *, max_length: int | None = None
) -> TokenizedDataset | None:
    """The ``data.train`` or ``data.validation`` dataset as a dataset of ``kind``; None when unset.

    The key holds a path or a :class:`~posttrain.config.schema.DataSource` (see
    :mod:`posttrain.data.sources`); its columns are renamed by its own ``columns``, else by
    ``data.columns``. ``max_length`` defaults to ``data.max_length``, then
    ``policy.max_total_sequence_length``; with the limit from the config, a dataset where most
    rows would be cut too short to train is refused (:mod:`posttrain.data.lengths`).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got '{split}'")
    data = config.data
    spec = getattr(data, split)
    if spec is None:
        return None
    source = open_source(spec, key=f"data.{split}", default_split=split, columns=data.columns, sources=config.sources)
    limit = max_length or data.max_length or config.policy.max_total_sequence_length
    dataset = build_dataset(source, kind, encoder, fmt=data.format, max_length=limit, skip_malformed=data.skip_malformed)
    if max_length is None:
        check_lengths(config, split, kind, dataset.report)
    return dataset


def require_dataset(
    config: RunConfig, split: str, kind: str, encoder: ChatEncoder, *, max_length: int | None = None
) -> TokenizedDataset:
    """Like :func:`dataset_from_config`, but an unset key is a config error naming it."""
    dataset = dataset_from_config(config, split, kind, encoder, max_length=max_length)
    if dataset is None:
        raise ConfigError(
            f"data.{split} is not set; {config.algorithm or 'this algorithm'} needs a file of {kind} data "
            f"(.jsonl, .json or .parquet), a dataset folder, or a Hub dataset (data.{split}: {{name: org/dataset}})"
        )
    return dataset


def dataloader_from_config(
    config: RunConfig, dataset: TokenizedDataset, batch_size: int, *, train: bool = True
) -> StatefulDataLoader:
    """Training loaders shuffle (``data.shuffle``, seeded by ``data.seed`` or the run's seed)
    and drop the last partial batch; validation loaders keep file order and every sample."""
    seed = config.data.seed if config.data.seed is not None else config.seed
    return StatefulDataLoader(
        dataset, batch_size, shuffle=train and config.data.shuffle, seed=seed, drop_last=train
    )
