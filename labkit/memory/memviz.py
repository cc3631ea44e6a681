"""Export a ledger's timeline to PyTorch's memory viewer (pytorch.org/memory_viz), on any device.

The viewer reads what `torch.cuda.memory._snapshot()` produces: a dict with `segments` (the caching
allocator's blocks) and `device_traces` (one list of events per device). Its "Active Memory Timeline"
walks the trace: an `alloc` event adds a block at `addr` of `size` bytes; a `free_completed` on the
same address removes it; `frames` (the stack) label the block and an optional `category` colours it.
The ledger has no addresses and no allocator, so this export

- gives each storage a fresh synthetic address (blocks never overlap, a regrown storage gets a new one);
- writes no segments (the "Allocator State History" view is meaningless without an allocator);
- turns a storage resized in place (`untyped_storage().resize_()`, as FSDP and ZeRO-3 do) into a free
  of the old block and an alloc of the new size;
- names each block by the aten op that made it, its shape and dtype, and the phase and step, as one frame;
- keeps one event in the category "unknown": the viewer's legend code appends "unknown" through a
  misspelt field when no event has it, and throws (torch/utils/viz/MemoryViz.js, `annotate_snapshot`);
- pickles with protocol 4: the viewer's JavaScript unpickler reads protocols 2-4 only (Python 3.14
  writes 5 by default).

Open the file at https://pytorch.org/memory_viz (drag it onto the page): the viewer runs in the browser
and needs internet to load its script, the file itself stays local.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

from .report import Category

# The viewer's (and torch.profiler's) category names for labkit's tags.
VIZ_CATEGORY = {
    Category.PARAM: "parameter",
    Category.BUFFER: "buffer",
    Category.GRAD: "gradient",
    Category.OPT: "optimizer_state",
    Category.ACT: "activation",
    Category.TEMP: "temporary",
}
_ALIGN = 512  # the CUDA caching allocator rounds blocks to 512 bytes; addresses only need to be distinct
_BASE = 0x7F0000000000


@dataclass(frozen=True)
class Allocation:
    """What the ledger knew of one storage: its final tag, the op that made it, where in the step."""

    tag: Category
    op: str
    shape: tuple
    dtype: str
    phase: str
    step: int


@dataclass
class Trace:
    """The ledger's raw events: (storage id, +bytes or -bytes) in order, and each storage's description."""

    events: list[tuple[int, int]]
    allocations: list[Allocation]

    def snapshot(self, device: int = 0) -> dict:
        """The viewer's snapshot dict: no segments, one device trace of alloc / free events."""
        size: dict[int, int] = {}  # sid -> bytes now
        addr: dict[int, int] = {}  # sid -> synthetic address of its current block
        next_addr = _BASE
        trace: list[dict] = [_unknown_marker(next_addr, "alloc"), _unknown_marker(next_addr, "free_requested"),
                             _unknown_marker(next_addr, "free_completed")]
        for sid, delta in self.events:
            a = self.allocations[sid]
            old = size.get(sid, 0)
            new = old + delta
            if old:
                trace += [self._event("free_requested", addr[sid], old, a), self._event("free_completed", addr[sid], old, a)]
            if new:
                addr[sid], next_addr = next_addr, next_addr + -(-new // _ALIGN) * _ALIGN
                trace.append(self._event("alloc", addr[sid], new, a))
            size[sid] = new
        traces: list[list[dict]] = [[] for _ in range(device)] + [trace]
        return {"segments": [], "device_traces": traces}

    @staticmethod
    def _event(action: str, address: int, nbytes: int, a: Allocation) -> dict:
        name = f"{a.op or '(made outside the ledger)'} {list(a.shape)} {a.dtype}"
        return {"action": action, "addr": address, "size": nbytes, "stream": 0, "category": VIZ_CATEGORY[a.tag],
                "frames": [{"filename": f"{a.phase}, step {a.step}", "line": 0, "name": name}]}

    def dump(self, path: str | Path, device: int = 0) -> Path:
        """Write the snapshot, pickled with protocol 4, to `path`; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(self.snapshot(device), f, protocol=4)
        return path


def _unknown_marker(address: int, action: str) -> dict:
    """A zero-byte block in the category "unknown" (see the module's docstring for why)."""
    return {"action": action, "addr": address, "size": 0, "stream": 0, "category": "unknown",
            "frames": [{"filename": "labkit", "line": 0, "name": "(marker: the viewer needs one 'unknown' block)"}]}


def live_series(snapshot: dict, device: int = 0) -> list[int]:
    """Total live bytes after each alloc / free_completed event of a snapshot's trace (what the viewer draws)."""
    live, out, blocks = 0, [], {}
    for ev in snapshot["device_traces"][device]:
        if ev["action"] == "alloc":
            blocks[ev["addr"]] = ev["size"]
            live += ev["size"]
        elif ev["action"] in ("free_completed", "free"):
            live -= blocks.pop(ev["addr"])
        else:
            continue
        out.append(live)
    return out
