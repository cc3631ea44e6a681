"""Checks for lesson 07 (quantization): the bits per parameter of NF4 with double quantization, what one
outlier does to per-tensor absmax int8, and the bytes of an AWQ int4 layer.

Expected values come from the library: a tensor quantized with labkit.quant.quantize_nf4 and measured
with bits_per_param_nf4, the codes of labkit.quant.quantize_int8, and the buffers of a labkit.quant.Int4Linear.
"""

from __future__ import annotations

import random

import torch

from labkit.quant import Int4Linear, bits_per_param_nf4, quantize_int8, quantize_nf4
from labkit.quant.nf4 import DOUBLE_QUANT_BLOCKSIZE

from . import Inputs, checked_choice, close, failed, integer, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "nf4_bits": {"blocksize": (128, 32, 256, 512)},
    "zeros_per_tensor": {"bits": (8, 7, 9, 10, 12)},
    "awq_bytes": {"d_out": (384, 768), "d_in": (1536, 512), "group": (128, 64, 32)},
})


# ---- exercise 1: bits per parameter of NF4 with double quantization -------------------------------------
def nf4_bits_measured(blocksize: int, double_quant: bool = True) -> float:
    """Bits per parameter measured on a tensor of 4 second-level groups, less the one fp32 offset that double
    quantization keeps per tensor (32 bits shared by all values: it vanishes for a real layer)."""
    n = blocksize * DOUBLE_QUANT_BLOCKSIZE * 4
    w = torch.randn(n, generator=torch.Generator().manual_seed(0))
    packed, state = quantize_nf4(w, blocksize, double_quant)
    offset_bits = 32 / n if double_quant else 0.0
    return bits_per_param_nf4(packed, state) - offset_bits


def check_nf4_bits(answer, blocksize: int = 128) -> bool:
    name = f"bits per parameter of NF4 with double quantization, blocksize {blocksize}"
    value = number(answer, name)
    if value is None:
        return False
    expected = nf4_bits_measured(blocksize)
    formula = f"4 + 8/{blocksize} + 32/({blocksize} x {DOUBLE_QUANT_BLOCKSIZE})"
    # to within half the second-level scale's share for large blocks, so that leaving it out cannot pass
    tol = 5e-4 if blocksize <= 128 else 16 / (blocksize * DOUBLE_QUANT_BLOCKSIZE)
    if close(value, expected, abs_=tol):
        return passed(f"{name}: {expected:.4f} = {formula}: 4 bits of code, one 8-bit absmax code per block, "
                      f"one fp32 scale per {DOUBLE_QUANT_BLOCKSIZE} blocks (measured on a real tensor).")
    if close(value, 4 + 32 / blocksize, abs_=5e-4):
        return failed(f"{name}: {value:g} keeps a 32-bit absmax per block: that is without double quantization. "
                      "Double quantization stores each block's absmax as an 8-bit code.")
    if close(value, nf4_bits_measured(64), abs_=5e-4) or close(value, 4.5, abs_=5e-4):
        return failed(f"{name}: that is the figure for blocks of 64 (QLoRA's default); redo it for blocks of {blocksize}.")
    if close(value, 4 + 8 / blocksize, abs_=5e-5):
        return failed(f"{name}: almost: the second-level fp32 scale, one per {DOUBLE_QUANT_BLOCKSIZE} blocks, "
                      "is missing.")
    if close(value, 4.0, abs_=1e-9):
        return failed(f"{name}: the 4-bit codes alone; every block also needs its absmax to be dequantized.")
    if close(value, expected / 8, abs_=1e-4):
        return failed(f"{name}: that looks like bytes per parameter; give bits.")
    return failed(f"{name}: add up, per parameter: the code, the block's 8-bit absmax shared by {blocksize} "
                  f"values, and one fp32 scale shared by {blocksize} x {DOUBLE_QUANT_BLOCKSIZE} values.")


# ---- exercise 2: what one outlier does to per-tensor absmax int8 ----------------------------------------
def zeros_per_tensor(w: torch.Tensor, bits: int = 8) -> int:
    """How many values of w become code 0 under per-tensor absmax with `bits`-bit codes (most of them were not
    0): labkit.quant.quantize_int8's codes for 8 bits, the same rounding with 2**(bits-1) - 1 steps otherwise."""
    if bits == 8:
        return int((quantize_int8(w, "absmax", "tensor").codes == 0).sum())
    return int((torch.round(w / (w.abs().max() / (2 ** (bits - 1) - 1))) == 0).sum())


def check_zeros_per_tensor(answer, w: torch.Tensor, bits: int = 8) -> bool:
    qmax = 2 ** (bits - 1) - 1  # absmax codes -qmax..qmax: 127 for int8
    name = f"values of W that per-tensor absmax int{bits} rounds to 0"
    value = integer(answer, name)
    if value is None:
        return False
    # round(w / step) with step = max|W| / qmax (not zeros_per_tensor, which the student build stubs)
    expected = int((torch.round(w / (w.abs().max() / qmax)) == 0).sum())
    share = expected / w.numel()
    if value == expected:
        return passed(f"{name}: {expected} of {w.numel()} ({share:.1%}): the step is max|W|/{qmax} = "
                      f"{w.abs().max().item() / qmax:.3g}, set by the largest value; every |w| under half a step is lost.")
    scale = w.abs().max().item() / qmax
    per_row = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / qmax
    if value == int((torch.round(w / per_row) == 0).sum()):
        return failed(f"{name}: that is per channel (one scale per row); the question is one scale for the whole tensor.")
    if value == int((w.abs() < scale).sum()):
        return failed(f"{name}: a value becomes 0 when it is under *half* a step: round(w / step) = 0.")
    if value == int((w.abs() < w.abs().max().item() / (2 ** bits - 1)).sum()):
        return failed(f"{name}: absmax int{bits} uses {qmax} steps on each side of zero (codes -{qmax}..{qmax}), "
                      f"not {2 ** bits - 1} over the whole range.")
    if value == int((w == 0).sum()):
        return failed(f"{name}: that counts values that were already 0; count those the rounding makes 0.")
    return failed(f"{name}: the step is max|W| / {qmax}; count the values with round(w / step) == 0.")


# ---- exercise 3: the bytes of an AWQ int4 layer whose scale stays in the layer ---------------------------
def awq_layer_bytes(d_out: int, d_in: int, group: int) -> int:
    """Bytes of the buffers of an Int4Linear with AWQ's kept scale, measured on a real (d_out, d_in) layer."""
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    layer = Int4Linear.from_linear(lin, group, input_scale=torch.ones(d_in))
    return sum(t.numel() * t.element_size() for t in layer.buffers())


def check_awq_bytes(answer, d_out: int = 384, d_in: int = 1536, group: int = 128) -> bool:
    name = f"bytes of a ({d_out}, {d_in}) AWQ int4 layer, groups of {group}, its scale kept"
    value = integer(answer, name)
    if value is None:
        return False
    n, g = d_out * d_in, d_out * d_in // group
    expected = awq_layer_bytes(d_out, d_in, group)
    if value == expected:
        return passed(f"{name}: {expected:,} = n/2 + 3 n/{group} + 2 d_in = {n // 2:,} + {3 * g:,} + {2 * d_in:,} "
                      f"({8 * expected / n:.4f} bits per weight; measured on a real layer).")
    if value == n // 2 + 3 * g:
        return failed(f"{name}: that is int4 RTN; AWQ's scale stays in this layer (after a GELU nothing can absorb "
                      "it): one fp16 value per input feature.")
    if value == n // 2 + 3 * g + 2 * d_out:
        return failed(f"{name}: AWQ scales the input channels, the columns of W: one value per input feature ({d_in}).")
    if value in (n // 2 + 4 * g + 2 * d_in, n // 2 + 4 * g):
        return failed(f"{name}: the zero point is an integer from 0 to 15: labkit keeps it in one byte, the step in fp16.")
    if value in (n + 3 * g + 2 * d_in, n + 3 * g):
        return failed(f"{name}: two 4-bit codes share a byte: n/2 bytes of codes.")
    if value in (n // 2 + 5 * g + 2 * d_in, n // 2 + 5 * g + 4 * d_in):
        return failed(f"{name}: the step and the AWQ scale are stored in fp16 (2 bytes), not fp32.")
    if value == 8 * expected:
        return failed(f"{name}: that looks like bits; give bytes.")
    return failed(f"{name}: add up the packed codes (2 per byte), a 2-byte step and a 1-byte zero point per group of "
                  f"{group} weights, and a 2-byte scale per input feature.")


# ---- exercise 4: a function for blockwise zero-point int8, checked on fresh tensors ----------------------------
def zeropoint_blocks(x: torch.Tensor, blocksize: int):
    """Reference: (uint8 codes of x's shape, fp32 scale per block, uint8 zero point per block) from
    labkit.quant.quantize_int8(x, "zeropoint", "block", blocksize)."""
    q = quantize_int8(x, "zeropoint", "block", blocksize)
    return q.codes, q.scale, q.zero_point


def _tensors(seed: int) -> list[tuple[str, torch.Tensor, int]]:
    """Fresh tensors: a GELU output (lopsided), weights centred on 0, and one with no negative value at all."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name in ("a GELU output", "a centred tensor", "an all-positive tensor"):
        blocksize = rng.choice([32, 64, 128])
        shape = (rng.randint(2, 12), blocksize * rng.randint(1, 4))
        x = torch.randn(shape, generator=gen) * rng.uniform(0.5, 3)
        if name == "a GELU output":
            x = torch.nn.functional.gelu(x)
        elif name == "an all-positive tensor":
            x = x.abs() + rng.uniform(0.5, 2)
        out.append((name, x, blocksize))
    return out


def _flat(t, n: int) -> torch.Tensor | None:
    """t as a flat tensor of n values, or None when it is not a tensor-like of n values."""
    try:
        t = torch.as_tensor(t).detach().cpu().reshape(-1)
    except Exception:
        return None
    return t if t.numel() == n else None


def check_zeropoint_blocks(fn, seed: int | None = None) -> bool:
    what = "zeropoint_blocks(x, blocksize)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _tensors(random.randrange(1 << 30) if seed is None else seed)
    for name, x, blocksize in cases:
        where = f"{name} of shape {tuple(x.shape)}, blocks of {blocksize}"
        try:
            got = fn(x.clone(), blocksize)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {where}")
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return failed(f"{what}: return three things, (codes, scale, zero), for {where}")
        codes, scale, zero = zeropoint_blocks(x, blocksize)
        blocks = x.numel() // blocksize
        g_codes, g_scale, g_zero = _flat(got[0], x.numel()), _flat(got[1], blocks), _flat(got[2], blocks)
        if g_codes is None:
            return failed(f"{what}: the codes must hold one value per element of x ({x.numel()}), for {where}")
        if g_scale is None or g_zero is None:
            return failed(f"{what}: one scale and one zero point per block of {blocksize} values ({blocks} blocks), "
                          f"for {where}")
        if not torch.allclose(g_scale.double(), scale.double(), rtol=8 * torch.finfo(torch.float32).eps, atol=0):
            hint = ("no value is negative here: does your range still hold 0, so that 0 stays exact?"
                    if x.min() > 0 else "the step spreads each block's range over 255 steps")
            return failed(f"{what}: wrong scale for {where} ({hint}).")
        if not torch.equal(g_zero.double(), zero.double()):
            return failed(f"{what}: wrong zero point for {where} (it is the code that 0.0 gets: look at the block's "
                          "minimum and the step).")
        # the codes: equal, except by one where x / scale sits on a rounding tie (to a few fp32 ulps)
        t = x.reshape(-1, blocksize).double() / scale.double().clamp_min(1e-30)[:, None]
        tie = ((t - t.floor()) - 0.5).abs().reshape(-1) < 1e-4
        diff = (g_codes.double() - codes.reshape(-1).double()).abs()
        if bool((diff > 1).any()) or bool(((diff == 1) & ~tie).any()):
            return failed(f"{what}: wrong codes for {where} (round x / step, add the zero point, and keep the codes "
                          "inside 0..255).")
    return passed(f"{what}: right on {len(cases)} fresh tensors (lopsided, centred, all positive), as "
                  "labkit.quant.quantize_int8(x, \"zeropoint\", \"block\", blocksize) quantizes them.")


# ---- exercise 5: why absmax int8 maps the largest magnitude to 127 -----------------------------------------
WHY_127 = {
    "a": "dividing by 127 rounds more exactly in fp32 than dividing by 128",
    "b": "code 128 is kept free to mark a block whose absmax is 0",
    "c": "the largest magnitude may be negative or positive, and int8 reaches -128 but only +127: mapping it to "
         "127 gives both signs a code and keeps the grid symmetric around an exact 0",
}


def check_why_127(answer) -> bool:
    what = "why absmax int8 maps max|x| to 127 (codes -127..127) and not to 128"
    return checked_choice(
        answer, what, WHY_127, right="c",
        praise=f"{what}: right: +128 does not fit in an int8, so a positive absmax could not be coded; code "
                 f"-128 is left unused, 1 of 256.",
        hints={"a": f"{what}: a division rounds to within half an ulp whatever the divisor; look at the range of "
                 f"an int8 instead."},
        otherwise=f"{what}: an all-zero block gets scale 0 and codes 0 (look at the library's clamp_min); look at "
                 f"the range of an int8 instead.")
