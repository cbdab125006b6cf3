"""Tokenised datasets: read a dataset's rows, check and encode every row, collate batches.

Three kinds, by what an algorithm consumes (see :data:`~posttrain.data.formats.KIND_FORMATS`):

- ``sft``: one sequence per example.
- ``preference``: a chosen and a rejected sequence per example. Batches interleave them,
  chosen at even rows and rejected at odd rows, so any split into microbatches of even
  size keeps each pair together.
- ``prompt``: the prompt tokens (ending with the generation prompt) plus the per-sample
  ``messages``, ``answer``, ``metadata`` and ``task`` lists an RL loop and its
  environments need, and ``origin`` (``<source> row <n>``, for messages about the row).

Collated batches (:class:`posttrain.batch.Batch`) hold ``input_ids`` int64 [B, S]
right-padded with the tokenizer's pad id, ``input_lengths`` int64 [B], ``token_mask``
float32 [B, S] (1 on loss tokens, aligned with the token it scores) and ``sample_mask``
float32 [B]. ``sample_mask`` is 0 for an example that truncation left with no loss
tokens (for a pair: when either side has none) and for a truncated prompt.

Image rows (:mod:`posttrain.data.images`): the example keeps its images' encoded bytes (an
``images`` column; a pair keeps its prompt's once, and how many each side kept) and the batch
gains the per-sample ``pixel_values`` and grids lists the vision-language model takes
(:data:`~posttrain.data.images.IMAGE_FIELDS`).

Examples are stored tokenised in a Hugging Face ``datasets.Dataset`` (Arrow, in memory),
so a large dataset costs a few bytes per token rather than a Python object per token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from posttrain.batch import Batch, padded_tensor
from posttrain.data.chat import ChatEncoder, Encoded
from posttrain.data.columns import plan_columns, rename_row
from posttrain.data.files import Unparsable
from posttrain.data.formats import (
    FORMATS,
    KIND_FORMATS,
    PreferenceExample,
    PromptExample,
    RowError,
    SFTExample,
    detect_format,
    parse_row,
)
from posttrain.data.images import ENCODED_IMAGES, ImageInputs, image_parts, image_references, read_image
from posttrain.data.sources import RowSource, open_source
from posttrain.errors import ConfigError, DataError, did_you_mean
from posttrain.log import get_logger

#: What each kind needs, for messages about a file of the wrong kind.
KIND_NEEDS = {
    "sft": "conversations ('messages' ending with an assistant turn) or 'prompt' + 'response' rows",
    "preference": "preference rows ('prompt', 'chosen', 'rejected')",
    "prompt": "prompt rows ('messages' or 'prompt', with optional 'answer', 'task', 'metadata')",
}
_CHUNK_ROWS = 4096  # examples per Arrow chunk while building
_REPORTED_SKIPS = 5  # skipped rows quoted in the load report


@attrs.frozen
class LoadReport:
    """What loading a dataset did. ``source`` is its label (the path for a local file) and
    ``key`` the config key that named it (None for a source given in code); ``skipped``
    quotes the first few skipped rows' errors."""

    source: str
    format: str
    num_rows: int
    num_examples: int
    num_skipped: int
    skipped: tuple[str, ...]
    num_truncated: int
    num_without_loss: int  # examples with sample_mask 0
    key: str | None = None
    longest_without_loss: int = 0  # tokens, before truncation, of the longest example with sample_mask 0


class TokenizedDataset:
    """Encoded examples of one kind; :meth:`collate` makes a :class:`Batch` of any of them."""

    def __init__(self, table: Any, kind: str, pad_token_id: int, report: LoadReport, images: ImageInputs | None = None):
        self.table = table  # datasets.Dataset
        self.kind = kind
        self.pad_token_id = pad_token_id
        self.report = report
        self.images = images  # a vision-language model's image inputs: the batches of image rows get pixels

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One example's stored columns (ids and masks as lists; JSON columns decoded)."""
        return _decode(self.kind, self.table[int(index)])

    def drop_rows(self, problems: Mapping[int, str]) -> None:
        """Leave out the examples of the source rows ``problems`` names (row number -> what is
        wrong with it), counted and quoted in the report as skipped malformed rows; raises
        :class:`DataError` when no example is left."""
        keep = [i for i, row in enumerate(self.table["row"]) if row not in problems]
        skipped = [f"{self.report.source} row {row}: {problem}" for row, problem in sorted(problems.items())]
        if not keep:
            raise DataError(f"{self.report.source}: no usable rows ({self.report.num_rows} read, {len(skipped)} "
                            f"skipped); the first: {skipped[0]}")
        self.table = self.table.select(keep)
        report = self.report
        self.report = attrs.evolve(
            report, num_examples=len(keep), num_skipped=report.num_skipped + len(skipped),
            skipped=(*report.skipped, *skipped)[:_REPORTED_SKIPS],
        )
        get_logger().warning("skipped rows", source=report.source, skipped=len(skipped), first=skipped[:_REPORTED_SKIPS])

    @property
    def parts(self) -> tuple[TokenizedDataset, ...]:
        """The datasets read from one source each: this one (a mixture has several)."""
        return (self,)

    def rows(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        """The stored columns of the examples at ``indices``, plus ``origin`` (``<source> row <n>``)."""
        cols = self.table[[int(i) for i in indices]]
        return {**cols, "origin": [f"{self.report.source} row {row}" for row in cols["row"]]}

    def collate(self, indices: Sequence[int]) -> Batch:
        """The examples at ``indices`` as a batch (preference: 2 rows per example)."""
        return collate_rows(self.kind, self.rows(indices), self.pad_token_id, self.images)

    def set_default_task(self, task: str) -> None:
        """Give ``task`` to the prompt rows that name none."""
        tasks = [name or task for name in self.table["task"]]
        self.table = self.table.remove_columns("task").add_column("task", tasks)


def collate_rows(
    kind: str, cols: Mapping[str, Sequence[Any]], pad_token_id: int, images: ImageInputs | None = None
) -> Batch:
    """A batch of ``kind`` from stored columns (:meth:`TokenizedDataset.rows`): padded ids and
    masks; for prompts also the decoded ``messages``, ``answer``, ``metadata``, and ``task``,
    ``origin`` and, when the columns hold it, ``source``; with ``images``, the image fields
    (:data:`~posttrain.data.images.IMAGE_FIELDS`) of the ``images`` column, and for prompts
    the images themselves (:data:`~posttrain.data.images.ENCODED_IMAGES`)."""
    if kind == "preference":
        chosen = zip(cols["chosen_input_ids"], cols["chosen_token_mask"], strict=True)
        rejected = zip(cols["rejected_input_ids"], cols["rejected_token_mask"], strict=True)
        seqs = [seq for pair in zip(chosen, rejected, strict=True) for seq in pair]  # c0, r0, c1, r1, ...
        sample_mask = [m for m in cols["sample_mask"] for _ in range(2)]
    else:
        seqs = list(zip(cols["input_ids"], cols["token_mask"], strict=True))
        sample_mask = cols["sample_mask"]
    batch = _pad(seqs, sample_mask, pad_token_id)
    if images is not None and "images" in cols:
        if kind == "preference":  # each pair's rows: the prompt's images each side kept
            rows = [own[:n] for own, c, r in zip(cols["images"], cols["chosen_images"], cols["rejected_images"],
                                                 strict=True) for n in (c, r)]
        else:
            rows = list(cols["images"])
        batch.update(images.model_inputs(rows))
    if kind == "prompt":
        for name in ("messages", "answer", "metadata"):
            batch[name] = [json.loads(v) for v in cols[name]]
        for name in ("task", "origin", "source"):
            if name in cols:
                batch[name] = list(cols[name])
        if images is not None and "images" in cols:
            batch[ENCODED_IMAGES] = [list(own) for own in cols["images"]]
    return batch


def build_dataset(
    source: str | Path | RowSource,
    kind: str,
    encoder: ChatEncoder,
    *,
    fmt: str = "auto",
    max_length: int | None = None,
    skip_malformed: bool = False,
) -> TokenizedDataset:
    """Read ``source``, rename its columns, check every row and encode it.

    ``source`` is a path (a .jsonl, .json or .parquet file, or a dataset folder: see
    :mod:`posttrain.data.sources`) or an opened :class:`RowSource`. Columns are renamed as
    :func:`~posttrain.data.columns.plan_columns` says (the source's renames, or the common
    layouts of ``kind``). ``fmt`` is ``auto`` (the first row whose keys show a format fixes
    it for the dataset) or one of :data:`FORMATS`. A malformed row raises :class:`DataError`
    naming the source, the row (1-based; the line for JSON Lines) and the problem, unless
    ``skip_malformed``: then it is skipped, counted in the report and logged.
    """
    if kind not in KIND_FORMATS:
        raise ValueError(f"unknown dataset kind '{kind}'; kinds: {', '.join(KIND_FORMATS)}")
    if fmt != "auto" and fmt not in KIND_FORMATS[kind]:
        hint = did_you_mean(fmt, FORMATS) if fmt not in FORMATS else ""
        raise ConfigError(
            f"data.format: '{fmt}' does not fit {kind} data; use auto or one of {', '.join(KIND_FORMATS[kind])}.{hint}"
        )
    rows = source if isinstance(source, RowSource) else open_source(source)
    plan = plan_columns(rows, kind)
    label = rows.label
    builder = _TableBuilder(kind, images=encoder.images is not None)
    skipped: list[str] = []
    num_rows = num_truncated = num_without_loss = longest_without_loss = 0
    for number, row in rows:
        num_rows += 1
        try:
            if isinstance(row, Unparsable):
                raise RowError(row.reason)
            if plan and isinstance(row, dict):
                row = rename_row(row, plan)
            if fmt == "auto":
                fmt = _detect(label, kind, number, row)
            example = parse_row(row, fmt)
            columns, truncated, full_length = _encode(example, encoder, max_length, rows.folder)
        except RowError as exc:
            message = f"{label} row {number}: {exc}"
            if not skip_malformed:
                raise DataError(message) from None
            skipped.append(message)
            continue
        except ConfigError as exc:
            raise ConfigError(f"{label} row {number}: {exc}") from None
        num_truncated += truncated
        if not columns["sample_mask"]:
            num_without_loss += 1
            longest_without_loss = max(longest_without_loss, full_length)
        builder.add(columns, number)
    report = LoadReport(
        label, fmt, num_rows, builder.size, len(skipped), tuple(skipped[:_REPORTED_SKIPS]),
        num_truncated, num_without_loss, rows.key, longest_without_loss,
    )
    if num_rows == 0:
        raise DataError(
            f"{rows.prefix}{label} has no rows. Add rows to it, or set {rows.key or 'the source'} to a dataset that has some"
        )
    if builder.size == 0:
        raise DataError(
            f"{rows.prefix}{label}: no usable rows ({num_rows} read, {len(skipped)} skipped as malformed); "
            f"the first: {skipped[0]}"
        )
    _log_report(report)
    return TokenizedDataset(builder.finish(), kind, encoder.pad_token_id, report, encoder.images)


def _detect(label: str, kind: str, number: int, row: Any) -> str:
    """The dataset's format from this row's keys ("auto"), or a row error when they show none."""
    keys = sorted(row) if isinstance(row, dict) else []
    fmt = detect_format(row) if isinstance(row, dict) else None
    if fmt is None:
        raise RowError(
            f"cannot tell the row format from its keys {keys}; {kind} data needs {KIND_NEEDS[kind]} "
            "(or set data.format, or rename columns to these keys with data.columns)"
        )
    if fmt not in KIND_FORMATS[kind]:
        raise DataError(
            f"{label}: rows look like {fmt} data (row {number} has keys {keys}), but {kind} data needs "
            f"{KIND_NEEDS[kind]}"
        )
    return fmt


def _encode(
    example: Any, encoder: ChatEncoder, max_length: int | None, folder: str | None = None
) -> tuple[dict[str, Any], bool, int]:
    """The stored columns of one example, whether truncation cut it, and its tokens before
    truncation (the longer side of a pair). Relative image paths are read from ``folder``."""
    if isinstance(example, SFTExample):
        images, grids = _images(example.messages, example.images, encoder, folder)
        enc = encoder.encode(example.messages, max_length=max_length, tools=example.tools, image_grids=grids)
        columns = {"input_ids": enc.input_ids, "token_mask": enc.token_mask, "sample_mask": int(enc.num_loss_tokens > 0)}
        if encoder.images is not None:
            columns["images"] = images[:enc.num_images]
        return columns, enc.truncated, enc.full_length
    if isinstance(example, PreferenceExample):
        if image_parts(example.chosen) or image_parts(example.rejected):
            raise RowError("'chosen' or 'rejected' holds an image part; images go in the prompt, which both share")
        images, grids = _images(example.prompt, example.images, encoder, folder)
        pair: list[Encoded] = [
            encoder.encode([*example.prompt, *completion], loss_from=len(example.prompt), max_length=max_length,
                           image_grids=grids)
            for completion in (example.chosen, example.rejected)
        ]
        c, r = pair
        columns = {"chosen_input_ids": c.input_ids, "chosen_token_mask": c.token_mask,
                   "rejected_input_ids": r.input_ids, "rejected_token_mask": r.token_mask,
                   "sample_mask": int(c.num_loss_tokens > 0 and r.num_loss_tokens > 0)}
        if encoder.images is not None:  # one copy of the prompt's images; each side keeps its leading ones
            columns.update(images=images[:max(c.num_images, r.num_images)], chosen_images=c.num_images,
                           rejected_images=r.num_images)
        return columns, c.truncated or r.truncated, max(c.full_length, r.full_length)
    assert isinstance(example, PromptExample)
    images, grids = _images(example.messages, example.images, encoder, folder)
    enc = encoder.encode_prompt(example.messages, max_length=max_length, image_grids=grids)
    columns = {"input_ids": enc.input_ids, "token_mask": enc.token_mask, "sample_mask": int(not enc.truncated),
               "messages": json.dumps(example.messages), "answer": json.dumps(example.answer, default=str),
               "metadata": json.dumps(example.metadata, default=str), "task": example.task}
    if encoder.images is not None:
        columns["images"] = images[:enc.num_images]
    return columns, enc.truncated, enc.full_length


def _images(
    messages: Sequence[Any], row_images: Sequence[Any] | None, encoder: ChatEncoder, folder: str | None
) -> tuple[list[bytes], list[int]]:
    """The encoded bytes of a conversation's images and their grids (none for a text-only
    model: its encoder refuses image parts)."""
    images = [read_image(ref, folder) for ref in image_references(messages, row_images)]
    if not images or encoder.images is None:
        return images, []
    return images, encoder.images.grids(images)


class _TableBuilder:
    """Accumulate encoded columns and build the Arrow-backed dataset in chunks."""

    def __init__(self, kind: str, *, images: bool = False):
        import datasets

        seq = getattr(datasets, "List", None) or datasets.Sequence
        ids, mask, text = seq(datasets.Value("int32")), seq(datasets.Value("int8")), datasets.Value("string")
        common = {"sample_mask": datasets.Value("int8"), "row": datasets.Value("int64")}
        per_kind = {
            "sft": {"input_ids": ids, "token_mask": mask},
            "preference": {"chosen_input_ids": ids, "chosen_token_mask": mask,
                           "rejected_input_ids": ids, "rejected_token_mask": mask},
            "prompt": {"input_ids": ids, "token_mask": mask, "messages": text, "answer": text, "metadata": text,
                       "task": text},
        }[kind]
        if images:
            per_kind["images"] = seq(datasets.Value("binary"))
            if kind == "preference":
                per_kind.update(chosen_images=datasets.Value("int32"), rejected_images=datasets.Value("int32"))
        self.features = datasets.Features({**per_kind, **common})
        self.columns: dict[str, list[Any]] = {name: [] for name in self.features}
        self.parts: list[Any] = []
        self.size = 0

    def add(self, columns: dict[str, Any], row: int) -> None:
        for name, value in {**columns, "row": row}.items():
            self.columns[name].append(value)
        self.size += 1
        if len(self.columns["row"]) >= _CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        import datasets

        if self.columns["row"]:
            self.parts.append(datasets.Dataset.from_dict(self.columns, features=self.features))
            self.columns = {name: [] for name in self.features}

    def finish(self) -> Any:
        import datasets

        self._flush()
        return self.parts[0] if len(self.parts) == 1 else datasets.concatenate_datasets(self.parts)


def _pad(seqs: Sequence[tuple[list[int], list[int]]], sample_mask: Sequence[int], pad_token_id: int) -> Batch:
    input_ids = padded_tensor([ids for ids, _ in seqs], pad_token_id, torch.long)
    token_mask = padded_tensor([mask for _, mask in seqs], 0.0, torch.float32, width=input_ids.shape[1])
    return Batch(
        input_ids=input_ids,
        input_lengths=torch.tensor([len(ids) for ids, _ in seqs], dtype=torch.long),
        token_mask=token_mask,
        sample_mask=torch.tensor(list(sample_mask), dtype=torch.float32),
    )


def _decode(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    if kind == "prompt":
        row = {**row, **{k: json.loads(row[k]) for k in ("messages", "answer", "metadata")}}
    return row


def _log_report(report: LoadReport) -> None:
    log = get_logger()
    log.info("data loaded", source=report.source, format=report.format, examples=report.num_examples,
             truncated=report.num_truncated, without_loss=report.num_without_loss)
    if report.num_skipped:
        log.warning("skipped malformed rows", source=report.source, skipped=report.num_skipped,
                    first=list(report.skipped))
