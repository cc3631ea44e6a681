"""Checks for lesson 04 (gradient accumulation): the weight of a micro-batch's loss, and the largest
micro-batch whose predicted peak fits a budget.

Expected values come from the library: labkit.accumulate.split_sizes and the estimator's
`micro_batch=` option.
"""

from __future__ import annotations

from labkit.accumulate import split_sizes
from labkit.memory import fmt_bytes
from labkit.estimate import estimate

from . import close, failed, integer, number, passed


# ---- exercise 1: the weight of a micro-batch's loss ----------------------------------------------
def micro_weight(sizes: list[int], index: int) -> float:
    """m_i / B: a micro-batch's share of the batch's mean loss (sizes as labkit.accumulate.split_sizes checks them)."""
    sizes = split_sizes(sum(sizes), list(sizes))
    return sizes[index] / sum(sizes)


def check_micro_weight(answer, sizes: list[int], index: int) -> bool:
    name = f"weight of micro-batch {index + 1} of {list(sizes)}"
    value = number(answer, name)
    if value is None:
        return False
    expected, total, k = micro_weight(sizes, index), sum(sizes), len(sizes)
    m = sizes[index]
    if close(value, expected, rel=1e-6):
        return passed(f"{name}: {m}/{total} = {expected:.4g}. Each mean loss counts as many rows as it averages, "
                      "so the weighted sum is the batch's mean.")
    if close(value, 1 / k, rel=1e-6) and len(set(sizes)) > 1:
        return failed(f"{name}: 1/{k} is right only when the micro-batches are equal; this split is uneven, and a mean over "
                      f"{m} rows stands for {m} of the {total} rows.")
    if close(value, 1.0, rel=1e-6):
        return failed(f"{name}: adding the micro-batches' mean losses unweighted gives a gradient about {k} times too big.")
    if close(value, 1 / m, rel=1e-6):
        return failed(f"{name}: the micro-batch's loss is already a mean over its {m} rows; weight it by its share "
                      f"of the batch of {total}.")
    if close(value, total / m, rel=1e-6):
        return failed(f"{name}: upside down: the share is rows in this micro-batch / rows in the batch.")
    return failed(f"{name}: the batch's mean loss = sum over micro-batches of (rows in it / {total}) x its mean loss.")


# ---- exercise 2: the largest micro-batch that fits a budget -------------------------------------
def largest_micro_batch(config, batch: int, seq: int, budget: int, dtype: str = "fp32", checkpoint: str = "none",
                        device: str = "cpu") -> int:
    """The largest divisor m of batch whose predicted peak (estimate(..., micro_batch=m)) fits; 0 if none."""
    fits = [m for m in range(1, batch + 1) if batch % m == 0
            and estimate(config, batch, seq, dtype, device=device, checkpoint=checkpoint, micro_batch=m).peak.total <= budget]
    return max(fits, default=0)


def check_largest_micro_batch(answer, config, batch: int, seq: int, budget: int, dtype: str = "fp32",
                              checkpoint: str = "none", device: str = "cpu") -> bool:
    name = f"largest micro-batch in {fmt_bytes(budget)} (checkpoint={checkpoint})"
    m = integer(answer, name)
    if m is None:
        return False
    expected = largest_micro_batch(config, batch, seq, budget, dtype, checkpoint, device)

    def peak(k):
        return estimate(config, batch, seq, dtype, device=device, checkpoint=checkpoint, micro_batch=k).peak.total

    if m < 0 or m > batch:
        return failed(f"{name}: a micro-batch has between 1 and {batch} rows (0 if none fits).")
    if m and batch % m:
        return failed(f"{name}: {m} does not divide the batch of {batch}: every micro-batch must have the same size here.")
    if m == expected:
        if m == 0:
            return passed(f"{name}: none fits; even micro-batch 1 needs {fmt_bytes(peak(1))}.")
        return passed(f"{name}: {m} ({batch // m} micro-batch(es) per step), predicted peak {fmt_bytes(peak(m))}.")
    if m and peak(m) > budget:
        return failed(f"{name}: micro-batch {m} does not fit: its predicted peak is {fmt_bytes(peak(m))}. Try a smaller one.")
    return failed(f"{name}: a larger micro-batch fits too: compare estimate(..., micro_batch=k).peak.total with the budget "
                  "for every divisor k of the batch.")
