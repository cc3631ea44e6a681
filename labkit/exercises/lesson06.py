"""Checks for lesson 06 (GaLore): the state bytes of one projected matrix, and the rank at which
GaLore stops saving memory over AdamW.

Expected values come from labkit.optim.galore's own `state_bytes_for` formula (projector
r x min(m, n) plus Adam's m and v in the r x max(m, n) projected space).
"""

from __future__ import annotations

import math

from labkit.optim import galore

from . import close, failed, integer, number, passed


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
