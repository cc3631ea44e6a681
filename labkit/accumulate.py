"""Gradient accumulation: run a batch as micro-batches, one backward each, then one optimizer step.

Activations scale with the rows in flight, so a micro-batch of m rows out of B keeps about m/B of
the batch's activations (bytes: m x T x per-token activation bytes), while the gradient, summed over
the micro-batches with each loss scaled by its share m_i / B, is the big batch's mean-loss gradient:
sum_i (m_i / B) * mean_i(loss) = mean(loss). Exact for losses that are a mean over rows (or over
tokens when every row has the same number); with padding, weight by token counts instead.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch


def split_sizes(batch: int, micro_batch: int | Sequence[int]) -> list[int]:
    """Micro-batch sizes: an int must divide the batch; a list of sizes may be uneven and must sum to it."""
    if isinstance(micro_batch, (bool, str, bytes)):
        raise ValueError(f"micro_batch must be a positive integer or a list of them, got {micro_batch!r}")
    if isinstance(micro_batch, int):
        if micro_batch <= 0:
            raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
        if batch % micro_batch:
            raise ValueError(f"micro_batch={micro_batch} does not divide the batch of {batch}; pass a list of "
                             f"sizes such as {_uneven(batch, micro_batch)} for an uneven split")
        return [micro_batch] * (batch // micro_batch)
    try:
        sizes = [int(s) for s in micro_batch]
    except (TypeError, ValueError):
        raise ValueError(f"micro_batch must be a positive integer or a list of them, got {micro_batch!r}") from None
    if not sizes or any(s <= 0 for s in sizes) or sum(sizes) != batch:
        raise ValueError(f"micro_batch sizes {sizes} must be positive and sum to the batch of {batch}")
    return sizes


def _uneven(batch: int, m: int) -> list[int]:
    return [m] * (batch // m) + ([batch % m] if batch % m else [])


def _loss(model, x, y, loss_fn):
    """The micro-batch's mean loss: model(x, y) (labkit's GPT) or loss_fn(model(x), y)."""
    return model(x, y) if loss_fn is None else loss_fn(model(x), y)


# ---- the teaching version ---------------------------------------------------------------------------
def accumulate_grads(model, x: torch.Tensor, y: torch.Tensor, micro_batch, loss_fn: Callable | None = None) -> torch.Tensor:
    """Add the batch's mean-loss gradient to the parameters' .grad, one micro-batch at a time.

    Returns the batch's mean loss (detached). Only one micro-batch's activations are alive at a time.
    """
    sizes = split_sizes(x.shape[0], micro_batch)
    total = torch.zeros((), device=x.device)
    for xb, yb in zip(torch.split(x, sizes), torch.split(y, sizes)):
        share = xb.shape[0] / x.shape[0]  # m_i / B
        loss = _loss(model, xb, yb, loss_fn) * share
        loss.backward()  # frees this micro-batch's activations; .grad accumulates
        total += loss.detach()
    return total


# ---- the real one: one optimizer step, and no gradient all-reduce until the last micro-batch ----------
def accumulate_step(model, optimizer, x: torch.Tensor, y: torch.Tensor, micro_batch,
                    loss_fn: Callable | None = None, *, max_grad_norm: float | None = None,
                    set_to_none: bool = True) -> torch.Tensor:
    """One training step of the batch (x, y) as micro-batches: backward each, clip, step, zero grads.

    micro_batch: rows per micro-batch (dividing the batch) or a list of sizes (uneven split).
    Under DistributedDataParallel, gradients are all-reduced only with the last micro-batch
    (`model.no_sync()` around the others). Returns the batch's mean loss (detached).
    """
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
    sizes = split_sizes(x.shape[0], micro_batch)
    total = torch.zeros((), device=x.device)
    chunks = list(zip(torch.split(x, sizes), torch.split(y, sizes)))
    for i, (xb, yb) in enumerate(chunks):
        last = i == len(chunks) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            loss = _loss(model, xb, yb, loss_fn) * (xb.shape[0] / x.shape[0])
            loss.backward()
        total += loss.detach()
        del loss  # nothing of this micro-batch outlives its backward
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return total
