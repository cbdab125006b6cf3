"""Build the data pieces of a run from its config (``data`` and ``policy`` sections)."""

from __future__ import annotations

from posttrain.config.schema import DataSource, RunConfig
from posttrain.config.validate import where_set
from posttrain.data.chat import ChatEncoder, load_tokenizer, read_chat_template
from posttrain.data.dataset import TokenizedDataset, build_dataset
from posttrain.data.images import ImageInputs
from posttrain.data.lengths import check_lengths
from posttrain.data.loader import StatefulDataLoader
from posttrain.data.mixture import MixedDataset, Share, source_tag
from posttrain.data.sources import open_source
from posttrain.errors import ConfigError
from posttrain.log import get_logger


def encoder_from_config(config: RunConfig) -> ChatEncoder:
    """The chat encoder of the policy's tokenizer, with ``data.chat_template`` when set, and the
    image inputs of a vision-language ``policy.model``."""
    tokenizer = load_tokenizer(config.policy.tokenizer or config.policy.model)
    value = config.data.chat_template
    template = read_chat_template(value) if value else None
    source = f"data.chat_template ('{value}')" if value and "{" not in value else "data.chat_template"
    return ChatEncoder(tokenizer, template, source=source, images=ImageInputs.from_model(config.policy.model, tokenizer))


def dataset_from_config(
    config: RunConfig, split: str, kind: str, encoder: ChatEncoder, *, max_length: int | None = None
) -> TokenizedDataset | MixedDataset | None:
    """The ``data.train`` or ``data.validation`` dataset as a dataset of ``kind``; None when unset.

    The key holds a path or a :class:`~posttrain.config.schema.DataSource` (see
    :mod:`posttrain.data.sources`), or a list of them: a mixture
    (:mod:`posttrain.data.mixture`). A source's columns are renamed by its own ``columns``, else by
    ``data.columns``. ``max_length`` defaults to ``data.max_length``, then
    ``policy.max_total_sequence_length``; with the limit from the config, a dataset where most
    rows would be cut too short to train is refused (:mod:`posttrain.data.lengths`).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got '{split}'")
    spec = getattr(config.data, split)
    if spec is None:
        return None
    if not isinstance(spec, list):
        return _one_source(config, spec, f"data.{split}", split, kind, encoder, max_length)
    if not spec:
        raise ConfigError(f"data.{split} is an empty list; name at least one dataset{where_set(config, f'data.{split}')}")
    shares = [_share(config, item, f"data.{split}[{i}]", split) for i, item in enumerate(spec)]
    seen: dict[str, int] = {}
    for i, share in enumerate(shares):
        if share.tag in seen:
            raise ConfigError(
                f"data.{split}[{seen[share.tag]}] and data.{split}[{i}] are both named '{share.tag}' in metrics; "
                f"set a distinct tag on one of them (data.{split}[{i}].tag){where_set(config, f'data.{split}')}"
            )
        seen[share.tag] = i
    parts = [_one_source(config, item, f"data.{split}[{i}]", split, kind, encoder, max_length)
             for i, item in enumerate(spec)]
    mixture = MixedDataset(parts, shares)
    get_logger().info("data mixture", split=split, sources={share.tag: len(part) for share, part in zip(shares, parts, strict=True)},
                      samples_per_epoch=mixture.epoch_size())
    return mixture


def _share(config: RunConfig, spec: str | DataSource, key: str, split: str) -> Share:
    """What source ``spec`` (at ``key``) gives each epoch; weights and counts are for training only."""
    if not isinstance(spec, DataSource):
        return Share(source_tag(spec))
    shares = {"weight": spec.weight, "count": spec.count, "weight_schedule": spec.weight_schedule}
    if split != "train" and any(value is not None for value in shares.values()):
        field = next(name for name, value in shares.items() if value is not None)
        raise ConfigError(
            f"{key}.{field}: validation reads every row of every source once; weights and counts apply to "
            f"data.train. Remove it.{where_set(config, f'{key}.{field}')}"
        )
    schedule = tuple((float(b), float(w)) for b, w in spec.weight_schedule) if spec.weight_schedule else None
    return Share(source_tag(spec), spec.weight, spec.count, schedule)


def _one_source(
    config: RunConfig, spec: str | DataSource, key: str, split: str, kind: str, encoder: ChatEncoder,
    max_length: int | None,
) -> TokenizedDataset:
    data = config.data
    source = open_source(spec, key=key, default_split=split, columns=data.columns, sources=config.sources)
    limit = max_length or data.max_length or config.policy.max_total_sequence_length
    dataset = build_dataset(source, kind, encoder, fmt=data.format, max_length=limit, skip_malformed=data.skip_malformed)
    task = spec.task if isinstance(spec, DataSource) else None
    if task is not None:
        if kind != "prompt":
            raise ConfigError(f"{key}.task: a task names the environment of prompt rows (GRPO, distillation, "
                              f"evaluation); {kind} data has none. Remove it.{where_set(config, f'{key}.task')}")
        dataset.set_default_task(task)
    if max_length is None:
        check_lengths(config, split, kind, dataset.report)
    return dataset


def require_dataset(
    config: RunConfig, split: str, kind: str, encoder: ChatEncoder, *, max_length: int | None = None
) -> TokenizedDataset | MixedDataset:
    """Like :func:`dataset_from_config`, but an unset key is a config error naming it."""
    dataset = dataset_from_config(config, split, kind, encoder, max_length=max_length)
    if dataset is None:
        raise ConfigError(
            f"data.{split} is not set; {config.algorithm or 'this algorithm'} needs a file of {kind} data "
            f"(.jsonl, .json or .parquet), a dataset folder, or a Hub dataset (data.{split}: {{name: org/dataset}})"
        )
    return dataset


def dataloader_from_config(
    config: RunConfig, dataset: TokenizedDataset | MixedDataset, batch_size: int, *, train: bool = True
) -> StatefulDataLoader:
    """Training loaders shuffle (``data.shuffle``, seeded by ``data.seed`` or the run's seed)
    and drop the last partial batch; validation loaders keep file order and every sample."""
    seed = config.data.seed if config.data.seed is not None else config.seed
    return StatefulDataLoader(
        dataset, batch_size, shuffle=train and config.data.shuffle, seed=seed, drop_last=train
    )
