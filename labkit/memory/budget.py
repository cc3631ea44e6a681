"""Budgets: a simulated device size on CPU, the real limit on CUDA, and out-of-memory as a result."""

from __future__ import annotations

import contextlib
import gc
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from .report import CATEGORIES, Breakdown, Measurement
from .units import fmt_bytes


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """Raised by a ledger with a budget, where a device with that much memory would have failed."""

    def __init__(self, message: str, requested: int, budget: int, live: Breakdown):
        super().__init__(message)
        self.requested, self.budget, self.live = requested, budget, live


@contextlib.contextmanager
def cuda_limit(budget: int | None, device=None):
    """Cap this process's CUDA memory at `budget` bytes (set_per_process_memory_fraction), then lift it."""
    if budget is None:
        yield
        return
    dev = torch.device(device or "cuda")
    torch.cuda.empty_cache()  # cached blocks from earlier work would otherwise dodge the limit
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)


@dataclass
class BudgetResult:
    """The outcome of an experiment run against a memory budget."""

    fits: bool
    message: str  # "fits: 1.20 GiB of 8.00 GiB" or "does not fit: ..."
    peak: int  # bytes: measured peak if it ran, else the bytes in use plus the failed request
    measurement: Measurement | None = None
    value: object = None  # what fn returned, when it was not a Measurement


def run_within_budget(fn: Callable[[], object], budget: int) -> BudgetResult:
    """Run fn (which should measure under `budget`); an out-of-memory becomes a result.

    Memory returns to its baseline afterwards: the error's frames are cleared, garbage is collected
    and, on CUDA, the allocator's cache is emptied, so the notebook goes on.
    """
    if budget is None or budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    try:
        out = fn()
    except SimulatedOutOfMemoryError as e:
        need = e.live.total + e.requested
        msg = (f"does not fit: {fmt_bytes(need)} > {fmt_bytes(e.budget)} budget; "
               f"{describe_breakdown(e.live)} in use when {fmt_bytes(e.requested)} more was asked for")
        result = BudgetResult(False, msg, need)
        _release(e)
        return result
    except torch.OutOfMemoryError as e:  # a real device's allocator said no
        result = BudgetResult(False, f"does not fit (device out of memory): {str(e).splitlines()[0]}", budget)
        _release(e)
        return result
    meas = out if isinstance(out, Measurement) else None
    peak = meas.peak.total if meas else 0
    msg = f"fits: peak {fmt_bytes(peak)} of {fmt_bytes(budget)} budget" if meas else "fits"
    return BudgetResult(True, msg, peak, meas, None if meas else out)


def _release(e: BaseException) -> None:
    traceback.clear_frames(e.__traceback__)
    e.__traceback__ = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe_breakdown(b: Breakdown) -> str:
    """'activations 6.10 GiB, parameters 1.20 GiB, ...': the categories in use, largest first."""
    parts = [f"{c.value} {fmt_bytes(b.bytes[c])}" for c in sorted(CATEGORIES, key=lambda c: -b.bytes[c]) if b.bytes[c]]
    return ", ".join(parts) or "nothing"
