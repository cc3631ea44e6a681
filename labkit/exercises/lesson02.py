"""Checks for lesson 02 (mixed precision): bytes per parameter with fp32 masters, the window of usable
fp16 loss scales, the scale torch._scaled_mm expects, a function for the share of values fp16 flushes (checked on
fresh tensors), and why a loss scaler skips an overflowing step.

Expected values come from labkit.precision (bytes_per_param, flush_fraction, overflow_fraction and
the FP8 format table), never typed in.
"""

from __future__ import annotations

import math
import random

import torch

from labkit.precision import bytes_per_param, flush_fraction, overflow_fraction
from labkit.precision.fp8 import FORMATS, AMAX_FLOOR

from . import Inputs, checked_choice, close, failed, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "master_bytes": {"optimizer": ("sgd-momentum", "sgd", "adamw")},
    "scale_window": {"grads": (  # the smallest and the largest value set the window: each pair gives another
        (3e-9, 2e-7, 5e-5, 1e-2, 4.0), (1e-9, 2e-7, 5e-5, 1e-2, 2.0), (5e-10, 2e-7, 5e-5, 1e-2, 0.5),
        (2e-8, 2e-7, 5e-5, 1e-2, 30.0), (7e-9, 2e-7, 5e-5, 1e-2, 12.0), (4e-10, 2e-7, 5e-5, 1e-2, 1.5))},
    "scaled_mm_scale": {"amax": (1e4, 3e3, 2.5e5, 80.0), "fmt": ("e4m3", "e5m2")},
})

STATES = {"sgd": "no state", "sgd-momentum": "one momentum buffer", "adam": "two moments, m and v",
          "adamw": "two moments, m and v"}
MAX_EXPONENT = 64  # loss scales searched: 2**0 .. 2**64


# ---- exercise 1: model states with fp32 master weights ------------------------------------------
def check_master_bytes(answer, optimizer: str = "sgd-momentum", scheme: str = "master-bf16") -> bool:
    """Bytes per parameter of a 16-bit model with fp32 masters: 2 + 4 (weights) + 2 + 4 (gradients) + 4 x states."""
    name = f"bytes per parameter, {scheme}, {optimizer}"
    value = number(answer, name)
    if value is None:
        return False
    b = bytes_per_param(scheme, optimizer)
    opt = b.opt
    if close(value, b.total, abs_=0.01):
        return passed(f"{name}: {b.total}. 2 (16-bit working weights) + 4 (fp32 masters) + 2 (16-bit gradients, "
                      f"all alive in the teaching version) + 4 (fp32 master gradients) + {opt} ({STATES[optimizer]}).")
    autocast = bytes_per_param("autocast", optimizer).total
    fp32 = bytes_per_param("fp32", optimizer).total
    if close(value, autocast, abs_=0.01):
        return failed(f"{name}: {autocast} is torch.autocast's count, where the model itself stays fp32. Here the model "
                      "is 16-bit, the fp32 masters live in the optimizer, and backward makes 16-bit gradients before "
                      "they are cast into fp32 master gradients.")
    if close(value, b.total - 4, abs_=0.01):
        return failed(f"{name}: one fp32 copy is missing. The optimizer steps fp32 masters (4 bytes), and it "
                      "needs fp32 master gradients (4 bytes) to step them: count both.")
    if close(value, b.total - 2, abs_=0.01):
        return failed(f"{name}: backward writes 16-bit gradients into the 16-bit model first (2 bytes); the "
                      "teaching version casts all of them before freeing any.")
    if close(value, fp32, abs_=0.01):
        return failed(f"{name}: {fp32} is plain fp32 training. The masters come on top of a 16-bit model: "
                      "mixed precision does not shrink model states.")
    for other in ("sgd", "sgd-momentum", "adamw"):
        if other != optimizer and STATES[other] != STATES[optimizer] and \
                close(value, bytes_per_param(scheme, other).total, abs_=0.01):
            return failed(f"{name}: that counts the optimizer state of {other} ({STATES[other]}); "
                          f"{optimizer} keeps {STATES[optimizer]}, 4 bytes each in fp32.")
    return failed(f"{name}: add up, per parameter, the 16-bit working weight (2), its fp32 master (4), the "
                  f"16-bit gradient (2), the fp32 master gradient (4) and {optimizer}'s {STATES[optimizer]} (fp32).")


# ---- exercise 2: the window of usable loss scales ---------------------------------------------------
def scale_window(grads: torch.Tensor, dtype: str = "fp16") -> tuple[float | None, float | None]:
    """(smallest 2**k at which nothing flushes, largest 2**k at which nothing overflows), k = 0..64;
    None where no power of two in that range works."""
    scales = [2.0**k for k in range(MAX_EXPONENT + 1)]
    no_flush = [s for s in scales if flush_fraction(grads, dtype, s) == 0.0]
    no_overflow = [s for s in scales if overflow_fraction(grads, dtype, s) == 0.0]
    return (min(no_flush) if no_flush else None), (max(no_overflow) if no_overflow else None)


def _power_of_two(value: float) -> bool:
    return value > 0 and math.log2(value) == int(math.log2(value))


def check_scale_window(smallest, largest, grads, dtype: str = "fp16") -> bool:
    """The smallest power-of-two loss scale that flushes none of `grads` (a tensor, or its values as a sequence:
    an fp32 tensor, as torch.tensor makes of them) and the largest that overflows none."""
    grads = grads if isinstance(grads, torch.Tensor) else torch.tensor(grads)
    ok_lo = _check_smallest(smallest, grads, dtype)
    ok_hi = _check_largest(largest, grads, dtype)
    if ok_lo and ok_hi:
        print(f"   usable scales: 2^{int(math.log2(smallest))} to 2^{int(math.log2(largest))}. A dynamic scaler finds "
              "the top of this window by itself, backing off when it overflows.")
    return ok_lo and ok_hi


# The checks test the answers' defining property on the tensor (nothing flushes at S and something does at
# S/2; nothing overflows at S and something does at 2S), not scale_window, which the student build stubs.
def _flushes(grads, dtype, scale: float) -> bool:
    return scale >= 1 and flush_fraction(grads, dtype, scale) > 0.0


def _overflows(grads, dtype, scale: float) -> bool:
    return scale > 2.0**MAX_EXPONENT or overflow_fraction(grads, dtype, scale) > 0.0


def _check_power(value, name: str) -> bool:
    if not _power_of_two(value):
        return failed(f"{name}: {value:g} is not a power of two (2**k, k >= 0). Loss scales are powers of two, so "
                      "that scaling and unscaling change no mantissa bit.")
    return True


def _check_smallest(answer, grads, dtype) -> bool:
    name = "smallest loss scale"
    value = number(answer, name)
    if value is None or not _check_power(value, name):
        return False
    fmin = torch.finfo(torch.float16 if dtype == "fp16" else torch.bfloat16)
    tiny = float(grads.abs()[grads != 0].min())
    if not _flushes(grads, dtype, value) and (value == 1 or _flushes(grads, dtype, value / 2)):
        return passed(f"{name}: {value:g} = 2^{int(math.log2(value))}: the smallest value, {tiny:g}, times S is above "
                      f"half of {dtype}'s smallest subnormal, so it rounds to a subnormal instead of 0.")
    if _flushes(grads, dtype, value):
        f = flush_fraction(grads, dtype, value)
        return failed(f"{name}: at {value:g}, {f:.0%} of the values still flush to 0 in {dtype}: look at the smallest "
                      "one, times S.")
    subnormal = fmin.smallest_normal * fmin.eps
    if close(value, 2.0 ** math.ceil(math.log2(fmin.smallest_normal / tiny)), rel=1e-12):
        return failed(f"{name}: that lifts the smallest value above {dtype}'s smallest *normal* number; below it "
                      f"there are subnormals, down to {subnormal:g}. Flushing starts only under half of that.")
    if close(value, 2.0 ** math.ceil(math.log2(subnormal / tiny)), rel=1e-12):
        return failed(f"{name}: nothing flushes at {value:g}, but a smaller scale works too: a value above *half* "
                      f"the smallest subnormal ({subnormal / 2:g}) rounds up to it rather than to 0.")
    return failed(f"{name}: nothing flushes at {value:g}, but it is not the smallest such power of two: try halving it.")


def _check_largest(answer, grads, dtype) -> bool:
    name = "largest loss scale"
    value = number(answer, name)
    if value is None or not _check_power(value, name):
        return False
    fmax = torch.finfo(torch.float16 if dtype == "fp16" else torch.bfloat16).max
    big = float(grads.abs().max())
    if not _overflows(grads, dtype, value) and _overflows(grads, dtype, 2 * value):
        return passed(f"{name}: {value:g} = 2^{int(math.log2(value))}: {big:g} x S = {big * value:g} is still under "
                      f"{dtype}'s max, {fmax:g}; twice that would be inf.")
    if _overflows(grads, dtype, value):
        return failed(f"{name}: at {value:g} the largest value becomes {big * value:g} > {fmax:g}, {dtype}'s max: "
                      "it overflows to inf and the step would be skipped.")
    return failed(f"{name}: nothing overflows at {value:g}, but it is not the largest such power of two: try doubling it "
                  f"(the largest value is {big:g}, {dtype}'s max {fmax:g}).")


# ---- exercise 3: the scale torch._scaled_mm expects --------------------------------------------------
def scaled_mm_scale(amax: float, fmt: str = "e4m3") -> float:
    """The dequantization scale of a tensorwise fp8 tensor: 1/s = amax / fp8_max (what _scaled_mm takes)."""
    _, fmax = FORMATS[fmt]
    return max(amax, AMAX_FLOOR) / fmax


def check_scaled_mm_scale(answer, amax: float, fmt: str = "e4m3") -> bool:
    """scale_a of torch._scaled_mm for a tensor of this amax quantized per tensor to `fmt`."""
    name = f"scale_a for amax {amax:g} in {fmt}"
    value = number(answer, name)
    if value is None:
        return False
    expected = scaled_mm_scale(amax, fmt)
    _, fmax = FORMATS[fmt]
    if close(value, expected, rel=1e-3):
        return passed(f"{name}: {expected:.6g} = amax / {fmax:g}. The quantization scale s = {fmax:g} / amax maps amax "
                      "onto the format's max; _scaled_mm wants the reciprocal, which turns fp8 values back into real ones.")
    if close(value, 1 / expected, rel=1e-3):
        return failed(f"{name}: that is the quantization scale s = {fmax:g} / amax (x8 = x * s). torch._scaled_mm takes "
                      "the dequantization scale, its reciprocal.")
    for other, (_, omax) in FORMATS.items():
        if other != fmt and (close(value, amax / omax, rel=1e-3) or close(value, omax / amax, rel=1e-3)):
            return failed(f"{name}: that uses {other}'s max ({omax:g}); {fmt}'s max is {fmax:g}.")
    return failed(f"{name}: per tensor, x8 = x * s with s = fp8_max / amax ({fmt}: fp8_max = {fmax:g}); "
                  "the GEMM multiplies by the scale that undoes it.")


# ---- exercise 4 (code): the share of values that flush to zero ---------------------------------------
def _flush_cases(seed: int) -> list[tuple[torch.Tensor, float]]:
    """Fresh tensors: magnitudes log-uniform over 2^-48 .. 2^0 (both sides of fp16's 2^-24 at every scale drawn),
    random signs, about a tenth exact zeros (which never count as flushed), each with a loss scale 2^0 .. 2^12."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        shape = tuple(rng.randint(8, 40) for _ in range(rng.randint(1, 3)))
        mag = torch.exp2(-48 * torch.rand(shape, generator=g))
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        zero = torch.rand(shape, generator=g) < 0.1
        t = torch.where(zero, torch.zeros(shape), sign * mag)
        out.append((t, 2.0 ** rng.randint(0, 12)))
    return out


def check_flush_share(fn, seed: int | None = None) -> bool:
    """The learner's flush_share(tensor, scale), compared with labkit.precision.flush_fraction on fresh tensors."""
    what = "flush_share(tensor, scale)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _flush_cases(random.randrange(1 << 30) if seed is None else seed)
    for t, scale in cases:
        try:
            got = fn(t.clone(), scale)
            got = float(got)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for a tensor of shape {tuple(t.shape)}, "
                          f"scale 2^{math.log2(scale):g}")
        want = flush_fraction(t, "fp16", scale)
        if not close(got, want, rel=1e-6, abs_=1e-9):
            nonzero = t != 0
            if close(got, want * int(nonzero.sum()) / t.numel(), rel=1e-6, abs_=1e-9):
                hint = "a value that was 0 before the cast was not flushed: count among the nonzero values only"
            elif close(got, flush_fraction(t, "fp16", 1.0), rel=1e-6, abs_=1e-9):
                hint = "the loss scale multiplies the values before the cast"
            elif close(got, flush_fraction(t, "bf16", scale), rel=1e-6, abs_=1e-9):
                hint = "the cast is to fp16 (torch.float16)"
            else:
                hint = "multiply by the scale, cast to torch.float16, and count the nonzero values that became 0"
            return failed(f"{what}: wrong for a tensor of shape {tuple(t.shape)} at scale 2^{math.log2(scale):g} "
                          f"({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh tensors (magnitudes 2^-48 .. 1, some exact zeros, "
                  f"power-of-two scales): it agrees with labkit.precision.flush_fraction.")


# ---- exercise 5 (why): a dynamic scaler skips the step on overflow ----------------------------------
WHY_SKIP = {
    "a": "an inf or nan gradient gives no usable update (dividing it by S leaves it inf or nan), so the step's "
         "gradient is lost anyway; skipping it and halving S costs one step and keeps the weights finite",
    "b": "the gradients would be fine after the division by S; the step is skipped only so that the count of "
         "clean steps restarts",
    "c": "an optimizer step on fp16 gradients that hold inf runs much slower, so it is cheaper to skip it",
}


def check_why_skip(answer) -> bool:
    what = "why a dynamic loss scaler skips the optimizer step when a gradient overflows"
    return checked_choice(
        answer, what, WHY_SKIP, right="a",
        praise=f"{what}: right: one inf in the gradients would make the update (and soon every weight) inf "
                 f"or nan; a skipped step is cheap, a corrupted model is not.",
        hints={"b": f"{what}: work out what inf / S and nan / S are, and what the optimizer would do with them."},
        otherwise=f"{what}: speed is not the concern here; think about the weights after a step taken with an inf "
                 f"in the gradient.")
