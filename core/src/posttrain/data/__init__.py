"""Data loading: datasets -> checked rows -> chat-templated tokens and loss masks -> batches.

``sources`` opens what ``data.train`` / ``data.validation`` name (local files, ``save_to_disk``
folders, dataset repository folders, Hugging Face Hub datasets), ``files`` reads local
JSONL/JSON/parquet rows, ``columns`` renames columns to row keys, ``formats`` recognises and
checks rows, ``chat`` tokenises conversations with assistant-only loss masks, ``dataset``
stores the encoded examples and collates :class:`~posttrain.batch.Batch` es, ``mixture``
reads several sources as one, ``loader`` iterates batches resumably, and ``setup`` builds all
of it from a run's config.
"""

from posttrain.data.chat import ChatEncoder, Encoded, load_tokenizer, read_chat_template
from posttrain.data.columns import LAYOUTS, plan_columns
from posttrain.data.dataset import LoadReport, TokenizedDataset, build_dataset
from posttrain.data.formats import (
    FORMATS,
    KIND_FORMATS,
    ROW_KEYS,
    PreferenceExample,
    PromptExample,
    RowError,
    SFTExample,
    detect_format,
    parse_row,
)
from posttrain.data.loader import StatefulDataLoader
from posttrain.data.mixture import MixedDataset, Share
from posttrain.data.setup import dataloader_from_config, dataset_from_config, encoder_from_config, require_dataset
from posttrain.data.sources import RowSource, open_source

__all__ = [
    "FORMATS",
    "KIND_FORMATS",
    "LAYOUTS",
    "ROW_KEYS",
    "ChatEncoder",
    "Encoded",
    "LoadReport",
    "MixedDataset",
    "PreferenceExample",
    "PromptExample",
    "RowError",
    "RowSource",
    "SFTExample",
    "Share",
    "StatefulDataLoader",
    "TokenizedDataset",
    "build_dataset",
    "dataloader_from_config",
    "dataset_from_config",
    "detect_format",
    "encoder_from_config",
    "load_tokenizer",
    "open_source",
    "parse_row",
    "plan_columns",
    "read_chat_template",
    "require_dataset",
]
