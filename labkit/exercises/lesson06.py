"""Checks for lesson 06 (GaLore): the state bytes of one projected matrix, and the rank at which
GaLore stops saving memory over AdamW.

Expected values come from labkit.optim.galore's own `state_bytes_for` formula (projector
r x min(m, n) plus Adam's m and v in the r x max(m, n) projected space).
"""

from __future__ import annotations

import math
import numbers
import random

from labkit.optim import galore

from . import checked_choice, close, failed, integer, not_answered, number, passed, unanswered


def _matrix(shape) -> tuple[int, int]:
    shape = tuple(shape)
    if len(shape) != 2 or min(shape) <= 0:
        raise ValueError(f"shape must be a matrix (m, n), got {shape!r}")
    return int(shape[0]), int(shape[1])


# ---- exercise 1: GaLore's state for one matrix ---------------------------------------------------------
def galore_state_bytes(shape, rank: int, dtype_bytes: int = 4) -> int:
    """Projector (r x min(m, n)) + m and v of the projected gradient (r x max(m, n) each), in the weight's dtype."""
    return galore.state_bytes_for(_matrix(shape), rank, dtype_bytes)


def check_galore_state_bytes(answer, shape, rank: int, dtype_bytes: int = 4) -> bool:
    m, n = _matrix(shape)
    k, K, r, d = min(m, n), max(m, n), rank, dtype_bytes
    name = f"GaLore state of a {m} x {n} matrix at rank {r}"
    value = number(answer, name)
    if value is None:
        return False
    expected = galore_state_bytes((m, n), r, d)
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: {expected:,} B = {d} x {r} x ({k} + 2 x {K}): the projector is {r} x {k} (the smaller "
                      f"side), Adam's m and v are {r} x {K} each. AdamW would keep {d} x 2 x {m} x {n} = {2 * d * m * n:,} B "
                      f"({expected / (2 * d * m * n):.1%} of it).")
    if close(value, 2 * d * m * n, rel=1e-9):
        return failed(f"{name}: 2mn values is AdamW's state; GaLore keeps m and v of the rank-{r} projection only.")
    if k != K and close(value, d * r * (K + 2 * k), rel=1e-9):
        return failed(f"{name}: the sides are swapped. GaLore projects onto the smaller side, so the projector is "
                      f"{r} x {k} and the projected gradient (hence m and v) is {r} x {K}.")
    if close(value, 2 * d * r * K, rel=1e-9):
        return failed(f"{name}: m and v are right, but the projector P ({r} x {k}) is state too: it is kept between "
                      "SVDs, which happen only every update_proj_gap steps.")
    if close(value, d * r * (k + K), rel=1e-9):
        return failed(f"{name}: Adam keeps two moments of the projected gradient (m and v), each {r} x {K}.")
    if close(value, r * (k + 2 * K), rel=1e-9):
        return failed(f"{name}: that counts values; each is {d} bytes.")
    return failed(f"{name}: add the projector (rank x the smaller side) and two moments (rank x the larger side), "
                  f"{d} bytes per value.")


# ---- exercise 2: the rank where GaLore stops saving memory -----------------------------------------------
def break_even_rank(shape) -> int:
    """The smallest rank r whose GaLore state r(k + 2K) is at least AdamW's 2mn (any dtype: it cancels).
    Both come from galore.state_bytes_for (rank None: plain AdamW), which is linear in the rank."""
    shape = _matrix(shape)
    adamw, per_rank = galore.state_bytes_for(shape, None, 1), galore.state_bytes_for(shape, 1, 1)
    return -(-adamw // per_rank)  # ceil, in integers


def check_break_even_rank(answer, shape) -> bool:
    m, n = _matrix(shape)
    k, K = min(m, n), max(m, n)
    name = f"smallest rank at which GaLore's state of a {m} x {n} matrix is no smaller than AdamW's"
    r = integer(answer, name)
    if r is None:
        return False
    expected = break_even_rank((m, n))
    exact = 2 * m * n / (k + 2 * K)
    if r == expected:
        return passed(f"{name}: r = {expected} (r(k + 2K) >= 2mn gives r >= {exact:.1f}, {expected / k:.0%} of the "
                      "smaller side). Below it GaLore saves memory; at the ranks people use (k/4 and less) it saves a lot.")
    if r == k:
        return failed(f"{name}: at full rank ({k}) GaLore keeps {k * (k + 2 * K) / (2 * m * n):.2f} x AdamW's state: "
                      "it stops saving well before that. Solve r(k + 2K) >= 2mn.")
    if r == expected - 1:
        return failed(f"{name}: at r = {r} GaLore is still (just) smaller: {r * (k + 2 * K):,} < {2 * m * n:,} values. "
                      "Round up.")
    if r == math.ceil(m * n / (k + 2 * K)):
        return failed(f"{name}: Adam keeps two values per weight (m and v): compare with 2mn, not mn.")
    if k != K and r == math.ceil(2 * m * n / (K + 2 * k)):
        return failed(f"{name}: the sides are swapped: the projector is r x {k} (the smaller side), m and v are r x {K}.")
    return failed(f"{name}: GaLore keeps r(k + 2K) values, AdamW 2mn, with k = {k}, K = {K}: find the smallest whole r "
                  "for which the first is at least the second.")


# ---- exercise 3: a function for GaLore's state of an m x n matrix, checked on fresh shapes --------------------
def galore_state(m: int, n: int, r: int) -> int:
    """Reference: fp32 GaLore state of one (m, n) matrix at rank r, as the estimator counts it."""
    from labkit.estimate.optim_terms import galore_matrix_state

    return galore_matrix_state(m, n, r, 4, eight_bit=False)


def _cases(seed: int) -> list[tuple[int, int, int]]:
    """Fresh (m, n, r): a wide matrix, a tall one, and a rank near the smaller side."""
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        a, b = rng.randint(16, 2048), rng.randint(16, 2048)
        while a == b:
            b += 1
        out += [(min(a, b), max(a, b), rng.randint(1, min(a, b) // 2)),
                (max(a, b), min(a, b), rng.randint(1, min(a, b) // 2))]
    return out


def check_galore_state(fn, seed: int | None = None) -> bool:
    what = "galore_state(m, n, r)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _cases(random.randrange(1 << 30) if seed is None else seed)
    for m, n, r in cases:
        try:
            got = fn(m, n, r)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for m={m}, n={n}, r={r}")
        want = galore_state(m, n, r)
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or got != want:
            hint = ("the projector and the moments are sized by different sides: which side does GaLore project "
                    "onto, the smaller or the larger?" if m < n else
                    "it was right for a wide matrix? then look at which side is the smaller one for a tall matrix")
            return failed(f"{what}: wrong for m={m}, n={n}, r={r} (count the projector and each of Adam's moments "
                          f"as rank x a side, 4 bytes per value; {hint}).")
    return passed(f"{what}: right on {len(cases)} fresh matrices, wide and tall, as "
                  f"labkit.estimate.optim_terms.galore_matrix_state counts them.")


# ---- exercise 4: why GaLore's weights are not confined to rank r --------------------------------------------
WHY_RANK = {
    "a": "Adam's moments m and v are kept at the full m x n size, so the update is full rank",
    "b": "each step's update is rank r, but the projector is recomputed from a new gradient every "
         "update_proj_gap steps: successive updates lie in different subspaces, and their sum is not low rank",
    "c": "the SVD keeps all min(m, n) singular vectors, and only the moments are cut to rank r",
}


def check_why_rank(answer) -> bool:
    what = "why GaLore's weights can change by more than rank r over a run (where LoRA's B·A cannot)"
    return checked_choice(
        answer, what, WHY_RANK, right="b",
        praise=f"{what}: right: a sum of rank-r updates from different subspaces can reach full rank, while "
                 f"LoRA's change B·A is one rank-r product for the whole run.",
        hints={"a": f"{what}: look at exercise 1's count: what shape do GaLore's m and v have?"},
        otherwise=f"{what}: look at the projector's shape in exercise 1's count (rank x the smaller side): what is "
                 f"kept of the SVD?")
