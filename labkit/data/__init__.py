"""Text data for the lessons: the offline Shakespeare corpus, tokenizers and batches; token shards on disk
and a stream over them (labkit.data.shards; its DataLoader measurements: labkit.data.loading)."""

from labkit.data.shakespeare import (
    INSTALL_HINT,
    ByteTokenizer,
    CharTokenizer,
    CorpusNotInstalledError,
    corpus,
    get_batch,
    list_plays,
    load_tokens,
    read_play,
    strip_gutenberg,
    train_val_split,
)
from labkit.data.shards import LoaderCursor, ShardError, ShardReads, ShardStream, collate, open_shards, write_shards

__all__ = [
    "INSTALL_HINT",
    "ByteTokenizer",
    "CharTokenizer",
    "CorpusNotInstalledError",
    "corpus",
    "get_batch",
    "list_plays",
    "load_tokens",
    "read_play",
    "strip_gutenberg",
    "train_val_split",
    "LoaderCursor",
    "ShardError",
    "ShardReads",
    "ShardStream",
    "collate",
    "open_shards",
    "write_shards",
]
