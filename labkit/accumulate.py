"""Gradient accumulation: run a batch as micro-batches, one backward each, then one optimizer step.

Activations scale with the rows in flight, so a micro-batch of m rows out of B keeps about m/B of
the batch's activations (bytes: m x T x per-token activation bytes), while the gradient, summed over
the micro-batches with each loss scaled by its share, is the big batch's mean-loss gradient.

Which share depends on what the loss is a mean over (`weight`):

    weight="rows"    share m_i / B: sum_i (m_i / B) * mean_i(loss) = mean(loss). Exact when the loss is a
                     mean over rows, or over tokens when every row counts the same number of them.
    weight="tokens"  share n_i / N, n_i the micro-batch's counted targets (those != ignore_index, e.g.
                     padding), N the batch's: sum_i (n_i / N) * (sum_i(loss) / n_i) = sum(loss) / N, the
                     batch's mean over its counted tokens. With padding or ignore_index, rows weighting
                     gives the tokens of a sparsely filled micro-batch too much weight; this is the bug
                     the transformers Trainer fixed in 2024 (huggingface/transformers PR #34191: divide
                     each micro-batch's summed loss by the tokens of the whole accumulated batch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
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


WEIGHTS = ("rows", "tokens")


def micro_shares(y: torch.Tensor, sizes: Sequence[int], weight: str = "rows", ignore_index: int = -100) -> list[float]:
    """Each micro-batch's share of the batch's mean loss: m_i / B ("rows") or n_i / N ("tokens", counting
    the targets that are not `ignore_index`). The shares sum to 1."""
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    if weight == "rows":
        return [m / y.shape[0] for m in sizes]
    counts = [int((yb != ignore_index).sum()) for yb in torch.split(y, list(sizes))]
    total = sum(counts)
    if total == 0:
        raise ValueError(f"weight='tokens': every target is ignore_index ({ignore_index}): no token to learn from")
    return [n / total for n in counts]


@dataclass(frozen=True)
class Accumulation:
    """How a batch runs as micro-batches: their sizes, and each one's share of the batch's mean loss."""

    micro_batch: int | tuple  # rows per micro-batch (dividing the batch), or each micro-batch's rows (uneven)
    weight: str = "rows"  # "rows": share m_i / B; "tokens": n_i / N of the targets != ignore_index
    ignore_index: int = -100  # the target weight="tokens" does not count (padding), as F.cross_entropy's

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch, list):
            object.__setattr__(self, "micro_batch", tuple(self.micro_batch))
        mb = self.micro_batch
        sizes = mb if isinstance(mb, tuple) else (mb,)
        if not sizes or any(isinstance(m, bool) or not isinstance(m, int) or m <= 0 for m in sizes):
            raise ValueError(f"micro_batch must be a positive integer or a list of them, got {mb!r}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"weight must be one of {', '.join(WEIGHTS)}, got {self.weight!r}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an integer, got {self.ignore_index!r}")

    @classmethod
    def of(cls, micro_batch) -> "Accumulation":
        """`micro_batch` if it is an Accumulation, else Accumulation(micro_batch): sizes, rows weighting."""
        return micro_batch if isinstance(micro_batch, cls) else cls(micro_batch)

    def chunks(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """(x_i, y_i, share_i) per micro-batch, leaving out those with no counted target (share 0: their
        mean loss is 0/0 and their gradient nothing)."""
        sizes = split_sizes(x.shape[0], list(self.micro_batch) if isinstance(self.micro_batch, tuple)
                            else self.micro_batch)
        shares = micro_shares(y, sizes, self.weight, self.ignore_index)
        return [(xb, yb, s) for xb, yb, s in zip(torch.split(x, sizes), torch.split(y, sizes), shares) if s > 0]


def _loss(model, x, y, loss_fn):
    """The micro-batch's mean loss: model(x, y) (labkit's GPT) or loss_fn(model(x), y)."""
    return model(x, y) if loss_fn is None else loss_fn(model(x), y)


# ---- the teaching version ---------------------------------------------------------------------------
def accumulate_grads(model, x: torch.Tensor, y: torch.Tensor, micro_batch: int | Sequence[int] | Accumulation,
                     loss_fn: Callable | None = None) -> torch.Tensor:
    """Add the batch's mean-loss gradient to the parameters' .grad, one micro-batch at a time.

    micro_batch: rows per micro-batch or a list of sizes (each share m_i / B), or an Accumulation
    (weight="tokens": share n_i / N of the targets != ignore_index; the loss must then be the mean over
    those targets, as F.cross_entropy's with the same ignore_index is).
    Returns the batch's mean loss (detached). Only one micro-batch's activations are alive at a time.
    """
    total = torch.zeros((), device=x.device)
    for xb, yb, share in Accumulation.of(micro_batch).chunks(x, y):
        loss = _loss(model, xb, yb, loss_fn) * share
        loss.backward()  # frees this micro-batch's activations; .grad accumulates
        total += loss.detach()
    return total


# ---- the real one: one optimizer step, and no gradient all-reduce until the last micro-batch ----------
def accumulate_step(model, optimizer, x: torch.Tensor, y: torch.Tensor,
                    micro_batch: int | Sequence[int] | Accumulation, loss_fn: Callable | None = None, *,
                    max_grad_norm: float | None = None) -> torch.Tensor:
    """One training step of the batch (x, y) as micro-batches: backward each, clip, step, gradients to None.

    micro_batch: rows per micro-batch (dividing the batch), a list of sizes (uneven split), or an
    Accumulation (each micro-batch's share by rows or by counted tokens, see `accumulate_grads`).
    Under DDP, N counts this rank's tokens only and DDP averages the ranks equally: exact across ranks
    only when they count the same number (otherwise all-reduce N and rescale, as the Trainer does).
    Under DistributedDataParallel, gradients are all-reduced only with the last micro-batch
    (`model.no_sync()` around the others). Returns the batch's mean loss (detached).
    """
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
    total = torch.zeros((), device=x.device)
    chunks = Accumulation.of(micro_batch).chunks(x, y)
    for i, (xb, yb, share) in enumerate(chunks):
        last = i == len(chunks) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            loss = _loss(model, xb, yb, loss_fn) * share
            loss.backward()
        total += loss.detach()
        del loss  # nothing of this micro-batch outlives its backward
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total
