"""DataLoader knobs, measured: a checked `make_loader`, process memory (psutil), the copy-on-access growth
of workers that read Python lists (pytorch issue 13246), and step time with loading overlapped or not.

Everything a DataLoader worker runs lives here at module level: a spawned or forked worker cannot
import a function defined in a notebook cell.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from labkit.data.shards import ShardStream, collate


def make_loader(dataset, batch_size: int, num_workers: int = 0, prefetch_factor: int | None = None,
                pin_memory: bool = False, persistent_workers: bool = False, **kwargs) -> torch.utils.data.DataLoader:
    """A DataLoader over a ShardStream (collate: labkit.data.collate), with one-line errors for knob mistakes.

    prefetch_factor: batches each worker loads ahead (torch's default 2 when num_workers > 0); in flight at
      most num_workers x prefetch_factor batches. It needs workers: with num_workers=0 the main process
      loads each batch when asked, and there is nothing to prefetch with.
    pin_memory: batches land in page-locked memory, so a CUDA copy can be non_blocking (overlap compute).
    persistent_workers: keep the workers (and their memory) across epochs instead of restarting them.
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(f"prefetch_factor={prefetch_factor} needs num_workers > 0: with no workers the main process "
                         "loads each batch on demand and nothing is prefetched")
    if num_workers == 0 and persistent_workers:
        raise ValueError("persistent_workers=True needs num_workers > 0: there are no workers to keep")
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor must be a positive integer, got {prefetch_factor!r}")
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate,
                                       prefetch_factor=prefetch_factor, pin_memory=pin_memory,
                                       persistent_workers=persistent_workers, **kwargs)


# ----------------------------------------------------------------------------- what a loader holds


@dataclass(frozen=True)
class LoaderConfig:
    """One rank's streaming loader, as loader_ram counts it."""

    workers: int  # DataLoader worker processes (0: the loop loads itself)
    prefetch: int  # batches each worker keeps ready (prefetch_factor)
    batch: int  # rows per batch
    seq: int  # tokens per row
    shuffle_buffer: int = 256  # positions in each worker's shuffle buffer (0: no shuffling)
    shard_rows: int = 1024  # rows per shard file (a row holds seq + 1 tokens)

    def __post_init__(self) -> None:
        for name, least in (("workers", 0), ("prefetch", 1), ("batch", 1), ("seq", 1), ("shuffle_buffer", 0),
                            ("shard_rows", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"LoaderConfig.{name} must be an integer >= {least}, got {v!r}")


def loader_ram(workers: int, prefetch: int, batch: int, seq: int, shuffle_buffer: int, shard_rows: int,
               open_shards: int = 2) -> dict[str, int]:
    """RAM a streaming loader holds per rank, by term (none depends on the dataset's size):
    in flight: workers x prefetch batches (x, y int64), or one batch with no workers;
    shuffle buffer: positions only (8 bytes each) per worker; open shards: their mapped pages, at most."""
    units = max(workers, 1)
    in_flight = (workers * prefetch if workers else 1) * 2 * batch * seq * 8
    return {"batches in flight": in_flight, "shuffle buffers": units * shuffle_buffer * 8,
            "open shards (mapped pages)": units * open_shards * shard_rows * (seq + 1) * 2}


# ----------------------------------------------------------------------------- process memory


def process_memory(pid: int | None = None) -> dict[str, int]:
    """{"rss", "uss"} bytes of a process (default: this one). USS: the pages only it maps (psutil's
    memory_full_info, from /proc/PID/smaps on Linux); what it would give back if it exited."""
    info = psutil.Process(pid).memory_full_info()
    return {"rss": info.rss, "uss": info.uss}


def workers_uss() -> int:
    """Summed USS of this process's children (the DataLoader workers), bytes."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_full_info().uss
        except psutil.Error:  # a worker that just exited
            pass
    return total


@dataclass
class StreamMemory:
    """Memory of the training process while it streams one pass over a shard folder."""

    dataset_bytes: int  # token bytes on disk
    samples: int  # samples read
    uss_before: int  # USS before the pass (after opening the folder)
    uss_peak: int  # largest USS seen during the pass (sampled every `every` batches)
    rss_peak: int

    @property
    def growth(self) -> int:
        return self.uss_peak - self.uss_before


def stream_memory(folder, batch_size: int = 16, shuffle_buffer: int = 256, every: int = 8,
                  max_batches: int | None = None) -> StreamMemory:
    """Stream a shard folder in this process (num_workers=0) and sample its USS/RSS as it goes.

    The baseline is taken after the first batch: the loader's machinery and its first shard are then in
    place, and what follows is what streaming the rest of the epoch adds."""
    gc.collect()
    ds = ShardStream(folder, shuffle_buffer=shuffle_buffer)
    it = iter(make_loader(ds, batch_size))
    n = len(next(it)["index"])
    before = process_memory()
    peak_uss, peak_rss = before["uss"], before["rss"]
    for i, batch in enumerate(it, start=1):
        n += len(batch["index"])
        if i % every == 0:
            m = process_memory()
            peak_uss, peak_rss = max(peak_uss, m["uss"]), max(peak_rss, m["rss"])
        if max_batches is not None and i + 1 >= max_batches:
            break
    m = process_memory()
    return StreamMemory(ds.shards.nbytes, n, before["uss"], max(peak_uss, m["uss"]), max(peak_rss, m["rss"]))


def _fresh(what: str, code: str, args: list[str], timeout: float) -> str:
    """The last line `python -c code *args` prints in a fresh process that imports this checkout's labkit;
    a RuntimeError naming `what` with the last line of its stderr if it fails."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                                      + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed in its process: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return out.stdout.strip().splitlines()[-1]


def stream_memory_fresh(folder, timeout: float = 600, **kwargs) -> StreamMemory:
    """`stream_memory` in a fresh Python process: the training process's own memory, not this one's heap
    (a notebook kernel or a test session that has made and freed many tensors)."""
    import json

    code = ("import json, sys; from dataclasses import asdict; from labkit.data.loading import stream_memory; "
            "print(json.dumps(asdict(stream_memory(sys.argv[1], **json.loads(sys.argv[2])))))")
    return StreamMemory(**json.loads(_fresh("stream_memory", code, [str(folder), json.dumps(kwargs)], timeout)))


def in_memory_growth_fresh(folder, timeout: float = 600) -> int:
    """`in_memory_growth` in a fresh Python process (a long-lived heap can hand back memory it freed before,
    and the naive read then seems to cost nothing)."""
    code = "import sys; from labkit.data.loading import in_memory_growth; print(in_memory_growth(sys.argv[1]))"
    return int(_fresh("in_memory_growth", code, [str(folder)], timeout))


def in_memory_growth(folder) -> int:
    """USS growth of the naive way: read every shard into one in-memory tensor (what streaming avoids)."""
    from labkit.data.shards import open_shards

    gc.collect()
    before = process_memory()["uss"]
    s = open_shards(folder)
    data = torch.cat([torch.from_numpy(np.array(s.open(i))) for i in range(s.num_shards)])
    grown = process_memory()["uss"] - before
    del data
    gc.collect()
    return grown


# ----------------------------------------------------------------------------- copy-on-access (pytorch #13246)


class ListOfBytes(torch.utils.data.Dataset):
    """A map-style dataset that keeps its samples as a Python list of bytes objects (the leaky way)."""

    def __init__(self, n: int, width: int = 64):
        self.items = [i.to_bytes(8, "little") * (width // 8) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return len(self.items[i])  # reading the object writes its reference count: its page gets copied


class ArrayOfBytes(torch.utils.data.Dataset):
    """The same samples as one numpy array of fixed-width bytes (one buffer, no per-sample objects)."""

    def __init__(self, n: int, width: int = 64):
        self.items = np.repeat(np.arange(n, dtype="<u8"), width // 8).view(f"S{width}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return len(self.items[i])


def _sum_collate(batch: list[int]) -> int:
    return sum(batch)


def copy_on_access(dataset, num_workers: int = 2, batch_size: int = 4096) -> dict[str, int]:
    """Workers' summed USS after their first batch and after one epoch over `dataset`, with fork.

    With fork the workers share the parent's pages until they write one; CPython writes an object's
    reference count whenever the object is read, so a worker that reads every item of a list copies
    every page the list's objects live on. An array is one object: reading its rows copies nothing.

    Two other writes are kept out of the figure. The baseline is taken once *every* worker has
    delivered its first batch (batches arrive in worker order: batch k from worker k mod n), so a
    worker still starting up on a busy machine does not count its start-up as growth. And the
    parent's objects are frozen (`gc.freeze()`, as Python's docs advise before a fork) so that a
    cyclic collection in a worker, which writes the header of every container it visits, does not
    copy the parent's pages: what remains is the reference-count write this measures.
    """
    if "fork" not in torch.multiprocessing.get_all_start_methods():
        raise RuntimeError("copy-on-access needs the fork start method (Linux, macOS with fork): not available here")
    if num_workers < 1:
        raise ValueError(f"copy_on_access needs forked workers: num_workers={num_workers}, give 1 or more")
    batches = -(-len(dataset) // batch_size)
    if batches <= num_workers:
        raise ValueError(f"{len(dataset)} items make {batches} batches of {batch_size}: give more items than "
                         f"{num_workers * batch_size} so the epoch goes on after each worker's first batch")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                         collate_fn=_sum_collate, persistent_workers=True,
                                         multiprocessing_context="fork", prefetch_factor=1)
    gc.collect()
    gc.freeze()
    try:
        it = iter(loader)
        for _ in range(num_workers):
            next(it)
        first = workers_uss()
        last = first
        for _ in it:
            last = max(last, workers_uss())
    finally:
        gc.unfreeze()
    out = {"first": first, "end": last, "growth": last - first}
    del it, loader
    gc.collect()
    return out


# ----------------------------------------------------------------------------- step time


@dataclass
class StepTiming:
    """What a short training loop spent per step, waiting for data and computing."""

    knobs: str
    steps: int
    step_s: float  # mean wall time per step (data wait + compute)
    wait_s: float  # mean time blocked in next(loader)
    samples_per_s: float


def time_steps(dataset, batch_size: int, steps: int, compute_s: float = 0.0, warmup: int = 1,
               **loader_knobs) -> StepTiming:
    """Run `steps` steps: fetch a batch, then `compute_s` seconds of simulated compute (a sleep, as when a
    GPU runs the step and the CPU only waits), and time each part. The loader's knobs go to make_loader."""
    loader = make_loader(dataset, batch_size, **loader_knobs)
    it = iter(loader)
    for _ in range(warmup):  # worker start-up is not a step
        next(it)
    wait = 0.0
    t0 = time.perf_counter()
    done = 0
    for _ in range(steps):
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t
        if loader_knobs.get("pin_memory") and torch.cuda.is_available():
            batch["x"].to("cuda", non_blocking=True)
        if compute_s:
            time.sleep(compute_s)
        done += 1
    total = time.perf_counter() - t0
    del it
    knobs = ", ".join(f"{k}={v}" for k, v in loader_knobs.items()) or "num_workers=0"
    return StepTiming(knobs, done, total / max(done, 1), wait / max(done, 1), done * batch_size / max(total, 1e-9))


def cpu_count() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def time_epochs(dataset, batch_size: int, epochs: int = 3, max_batches: int | None = None,
                **loader_knobs) -> list[float]:
    """Wall seconds to the first batch of each epoch with one DataLoader reused across epochs: with
    persistent_workers=False every epoch starts its workers again (a fork and the dataset's pickling per
    worker, plus refilling the prefetch queue); with True they stay, and only the queue refills."""
    loader = make_loader(dataset, batch_size, **loader_knobs)
    out = []
    for _ in range(epochs):
        t = time.perf_counter()
        for i, _batch in enumerate(loader):
            if i == 0:
                out.append(time.perf_counter() - t)
            if max_batches is not None and i + 1 >= max_batches:
                break
    del loader
    return out
