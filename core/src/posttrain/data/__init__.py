"""Data loading: local files -> checked rows -> chat-templated tokens and loss masks -> batches.

``files`` reads JSONL/JSON/parquet rows, ``formats`` recognises and checks them, ``chat``
tokenises conversations with assistant-only loss masks, ``dataset`` stores the encoded
examples and collates :class:`~posttrain.batch.Batch` es, ``loader`` iterates batches
resumably, and ``setup`` builds all of it from a run's config.
"""

from posttrain.data.chat import ChatEncoder, Encoded, load_tokenizer, read_chat_template
from posttrain.data.dataset import LoadReport, TokenizedDataset, build_dataset
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
from posttrain.data.loader import StatefulDataLoader
from posttrain.data.setup import dataloader_from_config, dataset_from_config, encoder_from_config, require_dataset

__all__ = [
    "FORMATS",
    "KIND_FORMATS",
    "ChatEncoder",
    "Encoded",
    "LoadReport",
    "PreferenceExample",
    "PromptExample",
    "RowError",
    "SFTExample",
    "StatefulDataLoader",
    "TokenizedDataset",
    "build_dataset",
    "dataloader_from_config",
    "dataset_from_config",
    "detect_format",
    "encoder_from_config",
    "load_tokenizer",
    "parse_row",
    "read_chat_template",
    "require_dataset",
]
