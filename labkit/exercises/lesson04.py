"""Checks for lesson 04 (gradient accumulation): the weight of a micro-batch's loss, the largest
micro-batch whose predicted peak fits a budget, a function for the token shares of padded micro-batches
(checked on fresh batches), and why data parallelism may skip the all-reduce until the last micro-batch.

Expected values come from the library: labkit.accumulate.split_sizes and the estimator's
`micro_batch=` option.
"""

from __future__ import annotations

import random

import torch

from labkit.accumulate import micro_shares, split_sizes
from labkit.memory import fmt_bytes
from labkit.estimate import estimate

from . import Inputs, checked_choice, close, failed, integer, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "micro_weight": {"sizes": ([3, 3, 2], [4, 4, 2], [5, 3, 2], [6, 3, 3]), "index": (2, 0, 1)},
    "largest_micro_batch": {"checkpoint": ("full", "none", "selective", "sqrt"), "budget_scale": (1.0, 1.25, 1.5)},
})


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
                              checkpoint: str = "none", device: str = "cpu", budget_scale: float = 1.0) -> bool:
    """`budget_scale`: the budget is int(budget x budget_scale) bytes (1: the budget as given)."""
    budget = int(budget * budget_scale)
    name = f"largest micro-batch in {fmt_bytes(budget)} (checkpoint={checkpoint})"
    m = integer(answer, name)
    if m is None:
        return False

    def peak(k):
        return estimate(config, batch, seq, dtype, device=device, checkpoint=checkpoint, micro_batch=k).peak.total

    if m < 0 or m > batch:
        return failed(f"{name}: a micro-batch has between 1 and {batch} rows (0 if none fits).")
    if m and batch % m:
        return failed(f"{name}: {m} does not divide the batch of {batch}: every micro-batch must have the same size here.")
    # the answer's property, from the estimator (not largest_micro_batch, which the student build stubs): m fits
    # (or is 0) and no larger divisor of the batch does
    if (m == 0 or peak(m) <= budget) and not any(peak(k) <= budget for k in range(m + 1, batch + 1) if batch % k == 0):
        if m == 0:
            return passed(f"{name}: none fits; even micro-batch 1 needs {fmt_bytes(peak(1))}.")
        return passed(f"{name}: {m} ({batch // m} micro-batch(es) per step), predicted peak {fmt_bytes(peak(m))}.")
    if m and peak(m) > budget:
        return failed(f"{name}: micro-batch {m} does not fit: its predicted peak is {fmt_bytes(peak(m))}. Try a smaller one.")
    return failed(f"{name}: a larger micro-batch fits too: compare estimate(..., micro_batch=k).peak.total with the budget "
                  "for every divisor k of the batch.")


# ---- exercise 3 (code): token shares of padded micro-batches ----------------------------------------------
def _padded_cases(seed: int) -> list[tuple]:
    """Fresh padded batches: targets (rows, seq) whose rows end in a random run of ignore_index, split into
    uneven micro-batches; the ignore_index is -100 or another value."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for ignore in (-100, rng.choice([-1, 0])):
        rows, seq = rng.randint(4, 12), rng.randint(8, 32)
        y = torch.randint(1, 1000, (rows, seq), generator=g)
        for r in range(rows):
            y[r, rng.randint(1, seq):] = ignore  # every row keeps at least one counted token
        sizes, left = [], rows
        while left:
            sizes.append(rng.randint(1, left))
            left -= sizes[-1]
        out.append((y, sizes, ignore))
    return out


def check_token_shares(fn, seed: int | None = None) -> bool:
    """The learner's token_shares(y, sizes, ignore_index), compared with labkit.accumulate.micro_shares."""
    what = "token_shares(y, sizes, ignore_index)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _padded_cases(random.randrange(1 << 30) if seed is None else seed)
    for y, sizes, ignore in cases:
        where = f"a batch of {y.shape[0]} rows split {sizes}, ignore_index={ignore}"
        try:
            got = [float(s) for s in fn(y.clone(), list(sizes), ignore)]
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {where}")
        want = micro_shares(y, sizes, "tokens", ignore)
        if len(got) != len(want):
            return failed(f"{what}: {len(got)} shares for {len(sizes)} micro-batches ({where}); one share each.")
        if all(close(g_, w, rel=1e-6, abs_=1e-9) for g_, w in zip(got, want)):
            continue
        rows = micro_shares(y, sizes, "rows")  # = every position counted, padding included
        if all(close(g_, r, rel=1e-6, abs_=1e-9) for g_, r in zip(got, rows)):
            hint = ("that counts every position (the rows' shares); the pad positions, marked with the ignore_index "
                    "passed in, are not in the loss")
        elif all(close(g_, 1 / len(sizes), rel=1e-6) for g_ in got):
            hint = "equal shares ignore how many tokens each micro-batch holds"
        else:
            hint = "look at which targets F.cross_entropy averages over, in each micro-batch and in the whole batch"
        return failed(f"{what}: wrong for {where} ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh padded batches with uneven micro-batches: it agrees with "
                  f"labkit.accumulate.micro_shares(..., weight=\"tokens\").")


# ---- exercise 4 (why): DDP's all-reduce waits for the last micro-batch ---------------------------------
WHY_NO_SYNC = {
    "a": "the earlier micro-batches' gradients are not needed: only the last micro-batch's gradient is averaged "
         "across ranks",
    "b": "the all-reduce is a sum, and a sum of sums does not depend on the order: reducing the accumulated "
         "gradient once gives the same result as reducing each micro-batch's gradient and adding them",
    "c": "an all-reduce during backward would free the gradients of the earlier micro-batches",
}


def check_why_no_sync(answer) -> bool:
    what = "why data parallelism can skip the all-reduce on all but the last micro-batch"
    return checked_choice(
        answer, what, WHY_NO_SYNC, right="b",
        praise=f"{what}: right: the reduction is linear, so one all-reduce of the accumulated .grad equals "
                 f"the sum of one per micro-batch, for a fraction of the communication.",
        hints={"a": f"{what}: every micro-batch's gradient is in the step; look at what .grad holds when the last "
                 f"backward ends."},
        otherwise=f"{what}: an all-reduce replaces a tensor's values with the ranks' sum; it frees nothing. "
                 f"Compare reducing each micro-batch's gradient with reducing their sum.")
