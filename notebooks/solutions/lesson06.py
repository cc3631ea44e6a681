"""Reference solutions for lesson 06's exercises (tests/unit/test_exercises_05_06.py checks each one)."""

import math


# ---- exercise 1: GaLore's state for one matrix ---------------------------------------------------------
def galore_state_bytes(m: int, n: int, rank: int, bytes_per_value: int = 4) -> int:
    """Projector r x min(m, n) + Adam's m and v of the projected gradient, r x max(m, n) each."""
    return bytes_per_value * rank * (min(m, n) + 2 * max(m, n))


GALORE_STATE = galore_state_bytes(4096, 11008, 128)  # 13,369,344 B, vs 360,710,144 B for AdamW (3.7 %)


# ---- exercise 2: the rank where GaLore stops saving memory ---------------------------------------------------
def break_even_rank(m: int, n: int) -> int:
    """Smallest r with r(k + 2K) >= 2mn: GaLore's values against AdamW's (the bytes per value cancel)."""
    k, K = min(m, n), max(m, n)
    return math.ceil(2 * m * n / (k + 2 * K))


BREAK_EVEN_RANK = break_even_rank(4096, 11008)  # 3,454 of 4,096: GaLore saves memory below about 84 % of full rank


# ---- exercise 3: GaLore's state of an m x n matrix, as a function ---------------------------------------------
def galore_state(m: int, n: int, r: int) -> int:
    """fp32: the projector r x min(m, n) + Adam's m and v of the projected gradient, r x max(m, n) each."""
    return galore_state_bytes(m, n, r, 4)


# ---- exercise 4 --------------------------------------------------------------------------------------------
WHY_RANK = "b"
