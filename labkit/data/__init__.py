"""Text data for the lessons: the offline Shakespeare corpus, tokenizers and batches."""

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
]
