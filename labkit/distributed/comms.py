"""The collectives labkit's parallel algorithms use, each with its bytes on the wire from its definition.

Every algorithm file (data parallel, ZeRO, pipeline, tensor parallel, compression) communicates only
through these functions, so one `CommLog` sees all its traffic. The volume counted is the *logical*
one, per rank, of the bandwidth-optimal (ring) algorithm for each collective on N ranks of a payload
of S bytes (Patarasuk & Yuan 2009; NCCL's performance notes):

    all-reduce      2 (N-1)/N * S   (a reduce-scatter then an all-gather)
    all-gather        (N-1)/N * S   (S = the gathered, full tensor)
    reduce-scatter    (N-1)/N * S   (S = the full input before scattering)
    broadcast         (N-1)/N * S   (pipelined chain: every rank but the last forwards S; averaged)
    send / recv           S         (sender's side)

gloo does not run all of these as rings (it emulates reduce-scatter with a full all-reduce, twice
the traffic), so what its sockets carry is not what an NCCL cluster carries: count from the
definition, and cross-check the number of calls with `torch.distributed.tensor.debug.CommDebugMode`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Call", "CommLog", "wire_bytes", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
           "send", "isend", "recv", "barrier", "world", "rank", "new_group", "plain_group"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv")

# torch 2.13 renamed the one-tensor collectives (all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor
# -> reduce_scatter_single) and warns on every call of the old names; earlier torch has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def wire_bytes(op: str, size_bytes: int, world_size: int) -> float:
    """Bytes each rank sends for one `op` of a payload of `size_bytes` on `world_size` ranks (ring algorithms)."""
    if op not in OPS:
        raise ValueError(f"wire_bytes: unknown collective {op!r}; one of {', '.join(OPS)}")
    if world_size < 1:
        raise ValueError(f"wire_bytes: world_size must be >= 1, got {world_size}")
    n, s = world_size, size_bytes
    if op == "all_reduce":
        return 2 * (n - 1) / n * s
    if op in ("all_gather", "reduce_scatter", "broadcast"):
        return (n - 1) / n * s
    return float(s) if op == "send" else 0.0


@dataclass(frozen=True)
class Call:
    """One collective as the algorithm issued it."""

    op: str          # one of OPS
    size_bytes: int  # S of the definition above
    world_size: int  # ranks taking part
    wire: float      # bytes this rank sends by the definition
    tag: str = ""    # what the algorithm was doing ("grad bucket 3", "gather block 2", ...)


@dataclass
class CommLog:
    """Records every collective issued through this module while it is active (`with CommLog() as log:`)."""

    calls: list[Call] = field(default_factory=list)

    def __enter__(self) -> "CommLog":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def count(self, op: str | None = None) -> int:
        return sum(1 for c in self.calls if op is None or c.op == op)

    def wire(self, op: str | None = None) -> float:
        """Bytes this rank sent, by definition, over all calls (or calls of one op)."""
        return sum(c.wire for c in self.calls if op is None or c.op == op)

    def payload(self, op: str | None = None) -> int:
        return sum(c.size_bytes for c in self.calls if op is None or c.op == op)

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"calls": k, "payload_bytes": S total, "wire_bytes": sent}} for the ops that occurred."""
        out: dict[str, dict[str, float]] = {}
        for c in self.calls:
            d = out.setdefault(c.op, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0})
            d["calls"] += 1
            d["payload_bytes"] += c.size_bytes
            d["wire_bytes"] += c.wire
        return out


_ACTIVE: list[CommLog] = []


def _record(op: str, size_bytes: int, group, tag: str) -> None:
    if not _ACTIVE:
        return
    n = dist.get_world_size(group)
    call = Call(op, int(size_bytes), n, wire_bytes(op, int(size_bytes), n), tag)
    for log in _ACTIVE:
        log.calls.append(call)


def world(group=None) -> int:
    return dist.get_world_size(group)


def rank(group=None) -> int:
    return dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, op: str = "sum", group=None, async_op: bool = False, tag: str = ""):
    """In place: every rank ends with the sum (or mean, op="avg") of `t` over ranks.

    gloo has no AVG reduction, so "avg" is a sum followed by a division here on every backend (the
    division is exact for powers of two). With async_op the caller must `.wait()` the returned work
    and, for "avg", call `finish_avg(t, group)` after it."""
    if op not in ("sum", "avg", "max", "min"):
        raise ValueError(f"all_reduce: op must be 'sum', 'avg', 'max' or 'min', got {op!r}")
    _record("all_reduce", _nbytes(t), group, tag)
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}[op]
    work = dist.all_reduce(t, op=red, group=group, async_op=async_op)
    if async_op:
        return work
    if op == "avg":
        finish_avg(t, group)
    return t


def finish_avg(t: torch.Tensor, group=None) -> torch.Tensor:
    """The division that turns a summed all-reduce into a mean."""
    return t.div_(dist.get_world_size(group))


def all_gather(out: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, tag: str = ""):
    """`out` (N x shard, flat or along dim 0) receives every rank's `shard` in rank order."""
    n = dist.get_world_size(group)
    if out.numel() != n * shard.numel():
        raise ValueError(f"all_gather: output has {out.numel()} elements, expected {n} x {shard.numel()}")
    _record("all_gather", _nbytes(out), group, tag)
    work = _all_gather_single(out, shard, group=group, async_op=async_op)
    return work if async_op else out


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, op: str = "sum", group=None, async_op: bool = False,
                   tag: str = ""):
    """Rank r's `out` receives the sum (or mean, op="avg") over ranks of chunk r of `full` (N equal chunks)."""
    n = dist.get_world_size(group)
    if full.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter: input has {full.numel()} elements, expected {n} x {out.numel()}")
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter: op must be 'sum' or 'avg', got {op!r}")
    _record("reduce_scatter", _nbytes(full), group, tag)
    work = _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if async_op:
        return work
    if op == "avg":
        finish_avg(out, group)
    return out


def broadcast(t: torch.Tensor, src: int = 0, group=None, tag: str = "") -> torch.Tensor:
    """In place: every rank ends with rank `src`'s `t`."""
    _record("broadcast", _nbytes(t), group, tag)
    dist.broadcast(t, src=src, group=group)
    return t


def send(t: torch.Tensor, dst: int, group=None, tag: str = "") -> None:
    _record("send", _nbytes(t), group, tag)
    dist.send(t.contiguous(), dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group=None, tag: str = "") -> torch.Tensor:
    _record("recv", _nbytes(t), group, tag)
    dist.recv(t, src=src, group=group)
    return t


def new_group(ranks: list[int]):
    """A process group of these global ranks, with the run's timeout (labkit.distributed.launch sets
    LABKIT_PG_TIMEOUT_S; 60 s otherwise), not gloo's default of 30 minutes. Every rank must call it, for
    every group, in the same order."""
    return dist.new_group(sorted(ranks), timeout=timedelta(seconds=float(os.environ.get("LABKIT_PG_TIMEOUT_S", 60))))


def plain_group():
    """A gloo group of every rank without the TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper (which launch sets for
    readable collective mismatches), with the run's timeout. Two things break under the wrapper in torch 2.13
    on gloo: DDP's construction logging segfaults, and since the wrapper checks each operation across every
    rank, one dead worker breaks the others' sends (a parameter server must outlive it)."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        return dist.new_group(backend="gloo",
                              timeout=timedelta(seconds=float(os.environ.get("LABKIT_PG_TIMEOUT_S", 60))))
    finally:
        dist.set_debug_level(level)


def barrier(group=None) -> None:
    dist.barrier(group=group)


def isend(t: torch.Tensor, dst: int, group=None, tag: str = ""):
    """`send` that returns at once with a work handle to `.wait()` on: a pipeline stage posts its output and
    goes on to a backward (1F1B), where a blocking send could wait for a peer that is itself sending."""
    _record("send", _nbytes(t), group, tag)
    return dist.isend(t.contiguous(), dst=dst, group=group)
