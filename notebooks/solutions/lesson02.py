"""Reference solutions for lesson 02's exercises (tests/unit/test_exercises_02_04.py checks each one)."""

import math

import torch

from labkit.precision import flush_fraction, overflow_fraction


# ---- exercise 1: model states with fp32 master weights -------------------------------------------
def master_bytes_per_param(optimizer_states: int) -> int:
    """16-bit working weight 2 + fp32 master 4 + 16-bit gradient 2 (the teaching version casts all of
    them before freeing any) + fp32 master gradient 4 + 4 per fp32 optimizer state."""
    return 2 + 4 + 2 + 4 + 4 * optimizer_states


STATES = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}  # optimizer states per parameter (EX1.optimizer)
MASTER_BYTES_PER_PARAM = master_bytes_per_param(1)  # the lesson's own EX1, SGD with momentum: one buffer -> 16
ADAMW_MASTER_BYTES_PER_PARAM = master_bytes_per_param(2)  # AdamW: m and v -> 20


# ---- exercise 2: the window of usable loss scales --------------------------------------------------
def smallest_scale(grads: torch.Tensor, dtype: str = "fp16") -> float:
    """Double S from 1 until no value flushes to 0 when grads * S is cast to dtype."""
    s = 1.0
    while flush_fraction(grads, dtype, s) > 0:
        s *= 2
    return s


def largest_scale(grads: torch.Tensor, dtype: str = "fp16") -> float:
    """The largest power of two whose product with the largest |gradient| still fits: found by doubling."""
    s = 1.0
    while overflow_fraction(grads, dtype, 2 * s) == 0:
        s *= 2
    return s


def largest_scale_by_hand(grads: torch.Tensor) -> float:
    """The same by arithmetic: max |g| x S <= 65504 (fp16's max), S a power of two."""
    return 2.0 ** math.floor(math.log2(65504 / float(grads.abs().max())))


# The notebook's GRADS = torch.tensor(EX2.grads): smallest_scale(GRADS), largest_scale(GRADS). The lesson's own,
# [3e-9, 2e-7, 5e-5, 1e-2, 4.0]: 3e-9 x 16 = 4.8e-8 is above 2**-25 (half the smallest
# subnormal, 2**-24), so it rounds up to 2**-24; at 8 it rounds to 0. 4.0 x 8192 = 32768 fits; x 16384 = 65536 > 65504.
GRADS = torch.tensor([3e-9, 2e-7, 5e-5, 1e-2, 4.0])
SMALLEST_SCALE = smallest_scale(GRADS)  # 16
LARGEST_SCALE = largest_scale(GRADS)  # 8192


# ---- exercise 3: the scale torch._scaled_mm expects -------------------------------------------------
def scaled_mm_scale(amax: float, fp8_max: float = 448.0) -> float:
    """x8 = x * s with s = fp8_max / amax; torch._scaled_mm takes the dequantization scale 1 / s."""
    return amax / fp8_max


FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # each format's largest finite value


def scale_a_for(amax: float, fmt: str = "e4m3") -> float:
    """The notebook's EX3: scaled_mm_scale(EX3.amax, FP8_MAX[EX3.fmt])."""
    return scaled_mm_scale(amax, FP8_MAX[fmt])


SCALE_A = scaled_mm_scale(1e4)  # the lesson's own EX3, e4m3: 10**4 / 448 = 22.32


# ---- exercise 4 (code): the share of values that flush to zero ---------------------------------------
def flush_share(tensor, scale):
    """Scale, cast to fp16, and count the values that were nonzero and became 0, among the nonzero ones."""
    import torch

    x = tensor.detach().double()  # fp64: only the cast rounds, never the scaling
    nonzero = x != 0
    flushed = nonzero & ((x * scale).to(torch.float16) == 0)
    n = int(nonzero.sum())
    return int(flushed.sum()) / n if n else 0.0


# ---- exercise 5 (why) ---------------------------------------------------------------------------------
WHY_SKIP = "a"
