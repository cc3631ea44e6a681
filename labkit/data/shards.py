"""Tokenized shards on disk (fixed-width uint16 token rows, memory-mapped) and a stream over them that
splits an epoch across ranks x workers exactly, shuffles with a bounded buffer, and resumes exactly.

The layout of a shard folder (`write_shards`):

    index.json          {"format": "labkit-shards", "version": 1, "seq": S, "dtype": "uint16",
                         "vocab_size": V, "repeat": k, "seed": s, "corpus_tokens": N,
                         "shards": [{"file": "shard-00000.npy", "rows": n, "crc32": c}, ...]}
    shard-00000.npy     a numpy .npy array of shape (n, S + 1), dtype uint16: row i is one sample,
    shard-00001.npy     x = row[:-1], y = row[1:] (a next-token window of S + 1 tokens)

Memory: a stream holds at most `open_shards` memory maps and `shuffle_buffer` row indices, whatever
the number of shards: RAM stays flat as the dataset grows (only disk grows), the point of streaming.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

FORMAT, VERSION = "labkit-shards", 1
TOKEN_DTYPE = np.uint16  # bytes: 2 per token (a vocabulary up to 65,536, as GPT-2's 50,257 needs)


class ShardError(ValueError):
    """A shard folder that cannot be read as written: missing, truncated, corrupt, or the wrong layout."""


# ----------------------------------------------------------------------------- writing shards


def _windows(tokens: np.ndarray, seq: int, offset: int) -> np.ndarray:
    """Non-overlapping windows of seq + 1 tokens starting at `offset`: (n, seq + 1), a view."""
    width = seq + 1
    n = (len(tokens) - offset) // width
    return tokens[offset : offset + n * width].reshape(n, width)


def write_shards(folder, tokens, seq: int = 128, rows_per_shard: int = 1024, repeat: int = 1, seed: int = 0,
                 vocab_size: int = 256) -> Path:
    """Write `tokens` (1-D ints < vocab_size) as shards of `rows_per_shard` windows of seq + 1 tokens.

    repeat: the size knob. Copy k of the corpus (k = 0 .. repeat-1) is cut into windows starting at
      token offset (k * 7919) % (seq + 1), so each copy holds different windows (shifted by a prime),
      and its windows are written in a random order (numpy PCG64 seeded by (seed, k)). Repetition
      multiplies the bytes on disk by `repeat`; it never holds more than one copy in memory.
    Existing shards in `folder` are replaced. The last shard may hold fewer rows. Returns the folder.
    """
    tokens = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
    if tokens.ndim != 1 or len(tokens) < seq + 1:
        raise ValueError(f"tokens must be 1-D with at least seq + 1 = {seq + 1} tokens, got shape {tokens.shape}")
    for name, v in (("seq", seq), ("rows_per_shard", rows_per_shard), ("repeat", repeat), ("vocab_size", vocab_size)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if vocab_size > np.iinfo(TOKEN_DTYPE).max + 1 or int(tokens.max()) >= vocab_size or int(tokens.min()) < 0:
        raise ValueError(f"tokens must lie in [0, vocab_size={vocab_size}) and vocab_size <= 65536")
    tokens = tokens.astype(TOKEN_DTYPE)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("shard-*.npy"):
        old.unlink()
    shards, pending = [], []

    def flush(rows: np.ndarray) -> None:
        name = f"shard-{len(shards):05d}.npy"
        np.save(folder / name, np.ascontiguousarray(rows))
        shards.append({"file": name, "rows": int(len(rows)), "crc32": zlib.crc32(rows.tobytes())})

    for k in range(repeat):
        win = _windows(tokens, seq, (k * 7919) % (seq + 1))
        order = np.random.Generator(np.random.PCG64([seed, k])).permutation(len(win))
        for start in range(0, len(order), rows_per_shard):  # one shard's rows at a time
            pending.append(win[order[start : start + rows_per_shard]])
            have = sum(len(p) for p in pending)
            while have >= rows_per_shard:
                rows = np.concatenate(pending)
                flush(rows[:rows_per_shard])
                pending, have = [rows[rows_per_shard:]], have - rows_per_shard
    if pending and sum(len(p) for p in pending):
        flush(np.concatenate(pending))
    index = {"format": FORMAT, "version": VERSION, "seq": int(seq), "dtype": "uint16", "vocab_size": int(vocab_size),
             "repeat": int(repeat), "seed": int(seed), "corpus_tokens": int(len(tokens)), "shards": shards}
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    return folder


# ----------------------------------------------------------------------------- reading shards


@dataclass(frozen=True)
class ShardSet:
    """The index of a shard folder, checked against the files (sizes and shapes; `verify` reads the CRCs)."""

    folder: Path
    seq: int  # tokens per sample (a row holds seq + 1)
    vocab_size: int
    rows: tuple[int, ...]  # rows per shard
    files: tuple[str, ...]
    crc32: tuple[int, ...]
    repeat: int

    @property
    def num_shards(self) -> int:
        return len(self.rows)

    @property
    def num_samples(self) -> int:
        return int(sum(self.rows))

    @property
    def nbytes(self) -> int:
        """Bytes of token data on disk (headers aside): samples x (seq + 1) x 2."""
        return self.num_samples * (self.seq + 1) * np.dtype(TOKEN_DTYPE).itemsize

    def starts(self) -> np.ndarray:
        """Global index of each shard's first sample: (num_shards + 1,), the last entry is num_samples."""
        return np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)

    def open(self, shard: int) -> np.ndarray:
        """Memory-map one shard, read-only: (rows, seq + 1) uint16. A truncated or reshaped file raises ShardError."""
        path = self.folder / self.files[shard]
        if not path.is_file():
            raise ShardError(f"shard {self.files[shard]} is listed in {self.folder / 'index.json'} but missing")
        try:
            mm = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:  # numpy: "mmap length is greater than file size", bad header
            raise ShardError(f"shard {path.name} is truncated or not a .npy file ({e})") from None
        want = (self.rows[shard], self.seq + 1)
        if mm.shape != want or mm.dtype != TOKEN_DTYPE:
            raise ShardError(f"shard {path.name} holds {mm.shape} {mm.dtype}, the index says {want} uint16")
        return mm

    def verify(self) -> None:
        """Read every shard and compare its CRC-32 with the index (slow: reads all the data once)."""
        for i, crc in enumerate(self.crc32):
            got = zlib.crc32(np.ascontiguousarray(self.open(i)).tobytes())
            if got != crc:
                raise ShardError(f"shard {self.files[i]} is corrupt: CRC-32 {got:#010x}, the index says {crc:#010x}")


def open_shards(folder) -> ShardSet:
    """The ShardSet in `folder`, with a one-line error if the folder, its index or a shard is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ShardError(f"shard folder {folder} does not exist: make one with labkit.data.write_shards")
    index_path = folder / "index.json"
    if not index_path.is_file():
        raise ShardError(f"{folder} has no index.json: not a shard folder written by labkit.data.write_shards")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise ShardError(f"{index_path} is not valid JSON ({e})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ShardError(f"{index_path} is not a {FORMAT} v{VERSION} index")
    shards = index["shards"]
    if not shards:
        raise ShardError(f"{index_path} lists no shards")
    s = ShardSet(folder, index["seq"], index["vocab_size"], tuple(x["rows"] for x in shards),
                 tuple(x["file"] for x in shards), tuple(x["crc32"] for x in shards), index.get("repeat", 1))
    for f in s.files:
        if not (folder / f).is_file():
            raise ShardError(f"shard {f} is listed in {index_path} but missing")
    return s


# ----------------------------------------------------------------------------- splitting an epoch


def unit_range(num_samples: int, unit: int, units: int, equal: bool = False) -> tuple[int, int]:
    """[start, end) of the epoch's sample sequence read by `unit` of `units` (rank * workers + worker).

    The split is by sample, not by shard: unit u reads positions [u*N//U, (u+1)*N//U) of the epoch's
    sequence (shards in the epoch's order, concatenated). So every sample is read exactly once per epoch
    whatever the shard count, and units differ by at most one sample. When N % U != 0 and `equal` is
    True, every unit stops at N // U: the N % U samples at the ends of the longer units are dropped this
    epoch (different ones next epoch, since the shard order changes), and every rank runs the same number
    of steps (DDP needs that: a rank with one more batch waits forever in its all-reduce).
    """
    if not 0 <= unit < units:
        raise ValueError(f"unit must be in [0, {units}), got {unit}")
    start, end = unit * num_samples // units, (unit + 1) * num_samples // units
    if equal:
        end = start + num_samples // units
    return start, end


def shuffle_buffer_order(start: int, end: int, buffer: int, rng: np.random.Generator) -> Iterator[int]:
    """Positions start..end-1 in the order a shuffle buffer of `buffer` entries emits them.

    Fill the buffer, then for each new position: emit a random entry and put the new one in its place;
    at the end, drain the buffer in random order. buffer <= 1 keeps the order. Memory: `buffer` ints.
    """
    if buffer <= 1:
        yield from range(start, end)
        return
    buf: list[int] = []
    for pos in range(start, end):
        if len(buf) < buffer:
            buf.append(pos)
            continue
        j = int(rng.integers(buffer))
        buf[j], pos = pos, buf[j]
        yield pos
    rng.shuffle(buf)
    yield from buf


def collate(samples: list[dict]) -> dict:
    """DataLoader collate_fn for ShardStream samples: x, y (B, S) int64; index, unit, pos, epoch (B,) int64."""
    return {k: torch.stack([s[k] for s in samples]) if isinstance(samples[0][k], torch.Tensor)
            else torch.tensor([s[k] for s in samples]) for k in samples[0]}


@dataclass(frozen=True)
class ShardReads:
    """How a ShardStream reads its shard files."""

    open_shards: int = 2  # memory maps kept open at once (least recently used closed first)
    delay_s: float = 0.0  # seconds slept per sample read, a simulation of slow storage (network disk, object store)

    def __post_init__(self) -> None:
        if isinstance(self.open_shards, bool) or not isinstance(self.open_shards, int) or self.open_shards < 1:
            raise ValueError(f"open_shards must be an integer >= 1, got {self.open_shards!r}")
        if not isinstance(self.delay_s, (int, float)) or isinstance(self.delay_s, bool) or not self.delay_s >= 0:
            raise ValueError(f"delay_s must be a number of seconds >= 0, got {self.delay_s!r}")


class ShardStream(torch.utils.data.IterableDataset):
    """Stream a shard folder's samples: every sample once per epoch across ranks x DataLoader workers.

    rank, world_size: this process's place among the data-parallel ranks.
    shuffle_buffer: entries in the shuffle buffer (0 or 1: no shuffling within a unit's range).
    shuffle_shards: permute the shard order each epoch (seeded by (seed, epoch)) before splitting.
    equal: every unit reads N // (world * workers) samples (see `unit_range`), for DDP.
    reads: how the files are read (open memory maps, a simulated delay per sample; see `ShardReads`).

    Each sample is a dict: x, y (S,) int64; index (its global number in the folder); unit, pos (which
    unit read it, and the how-many-th of that unit's epoch); epoch. `state_dict()` / `load_state_dict()`
    save and restore the positions (units and their sample counts), exactly: a resumed stream regenerates
    the epoch's order from the seed and skips what was consumed, reading no data while it skips.
    """

    def __init__(self, folder, rank: int = 0, world_size: int = 1, shuffle_buffer: int = 0, seed: int = 0,
                 shuffle_shards: bool = True, equal: bool = False, reads: ShardReads = ShardReads()):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer!r}")
        self.shards = open_shards_(folder)
        self.rank, self.world_size, self.shuffle_buffer, self.seed = rank, world_size, shuffle_buffer, seed
        self.shuffle_shards, self.equal, self.reads = shuffle_shards, equal, reads
        self.epoch = 0
        self.consumed: dict[int, int] = {}  # unit -> samples of this pass handed out so far
        self._skip: dict[int, int] = {}  # unit -> samples to skip at the next pass (from load_state_dict)
        self.units_saved: int | None = None  # ranks x workers of a loaded state (checked when iterating)
        self.units_now: int | None = None  # ranks x workers of the last iteration
        self.shift = 0  # worker w reads unit rank * workers + (w + shift) % workers (see LoaderCursor)

    # ---- the epoch's sequence ------------------------------------------------------------------------
    def shard_order(self, epoch: int) -> np.ndarray:
        n = self.shards.num_shards
        if not self.shuffle_shards:
            return np.arange(n)
        return np.random.Generator(np.random.PCG64([self.seed, epoch, 1])).permutation(n)

    def _locate(self, order: np.ndarray):
        """Maps a position in the epoch's sequence to (shard, row)."""
        rows = np.asarray(self.shards.rows)[order]
        ends = np.cumsum(rows)
        return lambda pos: (int(order[i := int(np.searchsorted(ends, pos, side="right"))]),
                            int(pos - (ends[i] - rows[i])))

    def positions(self, unit: int, units: int, epoch: int) -> Iterator[int]:
        """The unit's positions in the epoch's sequence, in the order it yields them (no data read)."""
        start, end = unit_range(self.shards.num_samples, unit, units, self.equal)
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch, 2, unit]))
        return shuffle_buffer_order(start, end, self.shuffle_buffer, rng)

    # ---- iterating ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # a resumed loader asks worker 0 first, but the interrupted one would have asked worker `shift` next:
        # rotate which unit each worker reads so the batch order carries on unchanged
        unit, units = self.rank * workers + (worker + self.shift) % workers, self.world_size * workers
        if self.units_saved is not None and self.units_saved != units:
            raise ValueError(f"the state was saved with {self.units_saved} units (ranks x workers), this loader has "
                             f"{units}: resume with the same world_size and num_workers")
        self.units_now = units
        epoch, skip = self.epoch, self._skip.pop(unit, 0)  # a new pass starts the epoch over unless resumed
        self.consumed[unit] = skip
        locate = self._locate(self.shard_order(epoch))
        starts = self.shards.starts()
        maps: dict[int, np.ndarray] = {}  # shard -> memory map, least recently used first
        for k, pos in enumerate(self.positions(unit, units, epoch)):
            if k < skip:
                continue  # resuming: skip without reading
            shard, row = locate(pos)
            mm = maps.pop(shard, None)
            if mm is None:
                mm = self.shards.open(shard)
                if len(maps) >= self.reads.open_shards:
                    maps.pop(next(iter(maps)))  # unmap the least recently used shard: its pages leave RSS
            maps[shard] = mm
            tokens = np.array(mm[row], dtype=np.int64)  # a copy: (S + 1,)
            if tokens.max() >= self.shards.vocab_size:
                raise ShardError(f"shard {self.shards.files[shard]} row {row} is corrupt: token {int(tokens.max())} "
                                 f">= vocab_size {self.shards.vocab_size} (resume from the last state_dict)")
            if self.reads.delay_s:
                time.sleep(self.reads.delay_s)
            t = torch.from_numpy(tokens)
            self.consumed[unit] = k + 1
            yield {"x": t[:-1], "y": t[1:], "index": int(starts[shard] + row), "unit": unit, "pos": k, "epoch": epoch}
        maps.clear()
        self.consumed, self.units_saved, self.shift = {}, None, 0
        self.epoch += 1  # the next pass is the next epoch (a persistent worker's copy moves on by itself)

    def set_epoch(self, epoch: int) -> None:
        """Call at the start of every epoch (as DistributedSampler.set_epoch): a DataLoader's non-persistent
        workers copy this object at each epoch, so only the main process's epoch counts. A new epoch starts
        from its beginning; the epoch of a loaded state keeps its resume positions."""
        if int(epoch) != self.epoch:
            self.epoch, self.consumed, self._skip, self.units_saved, self.shift = int(epoch), {}, {}, None, 0

    # ---- resuming -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"epoch", "seed", "world_size", "consumed": {unit: samples}}: what this copy handed out."""
        return {"epoch": self.epoch, "seed": self.seed, "world_size": self.world_size, "units": self.units_now,
                "shift": self.shift,
                "consumed": {int(u): int(n) for u, n in self.consumed.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state` (from state_dict() or a LoaderCursor): same seed and world size required."""
        for key in ("epoch", "seed", "world_size", "consumed"):
            if key not in state:
                raise ValueError(f"state has no {key!r}: expected ShardStream.state_dict() or LoaderCursor.state_dict()")
        if state["seed"] != self.seed or state["world_size"] != self.world_size:
            raise ValueError(f"state was saved with seed {state['seed']} and world_size {state['world_size']}; this "
                             f"stream has seed {self.seed} and world_size {self.world_size}: the orders would differ")
        self.epoch = int(state["epoch"])
        self.consumed = {int(u): int(n) for u, n in state["consumed"].items()}
        self._skip = dict(self.consumed)
        self.units_saved = state.get("units")
        self.shift = int(state.get("shift", 0))


open_shards_ = open_shards  # ShardStream's `open_shards` argument shadows the function's name inside __init__


class LoaderCursor:
    """Where a training loop is in a ShardStream read through a DataLoader with workers.

    A worker's own counters run ahead of the loop by up to prefetch_factor batches, so the loop records
    the positions of the batches it actually consumed: `update(batch)` after each step, `state_dict()`
    to save; `ShardStream.load_state_dict` to resume (with the same number of workers). The DataLoader
    asks its workers in turn (0, 1, ..., 0, 1, ...), so after n batches the next comes from worker
    n % workers: the state's `shift` makes the resumed loader's worker 0 read that worker's unit.
    """

    def __init__(self, dataset: ShardStream, num_workers: int):
        self.dataset, self.num_workers = dataset, num_workers
        self.epoch, self.consumed = dataset.epoch, dict(dataset.consumed)
        self.shift0, self.batches = dataset.shift, 0

    def update(self, batch: dict) -> None:
        for unit, pos, epoch in zip(batch["unit"].tolist(), batch["pos"].tolist(), batch["epoch"].tolist()):
            if epoch != self.epoch:
                self.epoch, self.consumed, self.shift0, self.batches = epoch, {}, 0, 0
            self.consumed[unit] = max(self.consumed.get(unit, 0), pos + 1)
        self.batches += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.dataset.seed, "world_size": self.dataset.world_size,
                "units": self.dataset.world_size * max(self.num_workers, 1),
                "shift": (self.shift0 + self.batches) % max(self.num_workers, 1), "consumed": dict(self.consumed)}
