"""Reference solutions for lesson 11's exercises (tests/unit/test_exercises_11.py checks each one)."""

import math


# ---- exercise 1: the bytes one DGC step sends ----------------------------------------------------------------
def dgc_bytes(numels, density, world):
    """Per tensor k = ceil(numel x density), at least 1; every rank's k fp32 values and k int32 indices are
    all-gathered: each rank sends (N-1)/N of the N x 8 sum(k) gathered bytes."""
    k = sum(max(1, math.ceil(n * density - 1e-9)) for n in numels)
    return (world - 1) / world * world * 8 * k


# ---- exercise 2: why memory grows ----------------------------------------------------------------------------
WHY = "b"
