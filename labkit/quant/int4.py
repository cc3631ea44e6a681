"""Group-wise int4 weights with a zero point (round-to-nearest, "RTN"), the baseline AWQ improves on, and a
frozen Int4Linear that can also hold AWQ's per-input-channel scale.

A (d_out, d_in) weight is cut along its input dimension into groups of `group` values (128 by default, as
AWQ and GPTQ use). Each group gets an fp16 step and a uint8 zero point (an integer in 0..15):
    scale = (max - min) / 15      zero = round(-min / scale)      q = clamp(round(w / scale) + zero, 0, 15)
    w_hat = (q - zero) * scale    (the range [min, max] is stretched to hold 0, so that 0 is exact)
Two codes per byte, the first in the high nibble (labkit.quant.nf4.pack_nibbles).
Bytes (int4_bytes_for): n/2 + 3 n/group (+ 2 d_in for an AWQ scale kept in the layer), n = d_out d_in:
4 + 24/128 = 4.1875 bits per weight at group 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .matmul import dequant_linear
from .nf4 import pack_nibbles, pair_table, unpack_nibbles

INT4_GROUP = 128  # weights per (scale, zero) along the input dimension: AWQ's and GPTQ's default
LEVELS = 15  # codes 0..15: 15 steps between min and max
_SCALE_FLOOR = 2.0 ** -24  # the smallest fp16 step (a subnormal): an all-zero group keeps step > 0
# Dequantizing one weight (dequantize_int4) holds, at its worst moment, the int32 byte index (2 B per weight)
# beside the fp32 result (4 B), or the fp32 result and its 16-bit copy (2 B): 6 B per weight.
# Change it here if dequantize_int4 changes.
INT4_DEQUANT_BYTES_PER_WEIGHT = 6


def check_group(d_in: int, group: int, what: str = "the weight") -> None:
    """A clear error unless `group` is a positive even integer dividing d_in (the input features)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"int4 group size must be an even integer >= 2 (e.g. 32, 64, 128), got {group!r}")
    if d_in % group:
        divisors = [g for g in (32, 64, 128, 256) if d_in % g == 0]
        hint = f"e.g. {', '.join(map(str, divisors))}" if divisors else "a divisor of it"
        raise ValueError(f"int4 group size {group} does not divide the {d_in} input features of {what}: "
                         f"choose one that does ({hint})")


def int4_bytes_for(shape, group: int = INT4_GROUP, input_scale: bool = False) -> int:
    """Bytes of one (d_out, d_in) weight in int4 (what quantize_int4 / Int4Linear keep), n = d_out d_in:

        n/2 + 3 n/group          packed 4-bit codes + one fp16 scale (2 B) and one uint8 zero point (1 B)
                                 per group of `group` input features
        + 2 d_in                 with input_scale: AWQ's per-input-channel fp16 scale, kept in the layer
                                 when it cannot be folded into the operation before it

    4.1875 bits per weight at group 128 (4.375 at 64, 4.75 at 32).
    Source: Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
    Acceleration" (INT4, group size 128, zero point); this layout stores the zero point in a byte."""
    if len(shape) != 2:
        raise ValueError(f"int4 weights are 2-D (d_out, d_in), got shape {tuple(shape)}")
    d_out, d_in = shape
    check_group(d_in, group)
    n = d_out * d_in
    return n // 2 + 3 * (n // group) + (2 * d_in if input_scale else 0)


# ----------------------------------------------------------------------------- teaching version


def fake_quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, clip: torch.Tensor | None = None,
                       scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """w (d_out, d_in) -> the int4 round trip Q(w) in fp32, the same shape: what the layer will compute with.

    clip: optional (d_out, d_in/group) ratios in (0, 1]: each group is first clamped to +-ratio x its
    absmax (AWQ's clipping search), so the step shrinks and the few largest values saturate.
    scale_dtype: the dtype the step is stored in (fp16; fp32 to compare with a tool that keeps fp32 steps)."""
    scale, zero, codes = _int4_codes(w, group, clip, scale_dtype)
    return ((codes - zero) * scale).view(w.shape)


def _int4_codes(w: torch.Tensor, group: int, clip: torch.Tensor | None = None,
                scale_dtype: torch.dtype = torch.float16):
    """w -> (scale, zero, codes) as fp32 (d_out, d_in/group, 1), (..., 1), (d_out, d_in/group, group);
    the scale is already rounded to scale_dtype, as it is stored, so the codes agree with dequantization."""
    if w.dim() != 2:
        raise ValueError(f"int4 quantization takes a 2-D (d_out, d_in) weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"int4 quantization takes a floating-point weight, got {w.dtype}")
    d_out, d_in = w.shape
    check_group(d_in, group)
    g = w.detach().float().reshape(d_out, d_in // group, group)  # (d_out, groups, group)
    if clip is not None:
        if clip.numel() != d_out * (d_in // group):
            raise ValueError(f"clip needs one ratio per (row, group): {d_out} x {d_in // group}, got {tuple(clip.shape)}")
        limit = g.abs().amax(dim=2, keepdim=True) * clip.float().reshape(d_out, d_in // group, 1)
        g = torch.maximum(torch.minimum(g, limit), -limit)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # the range always holds 0
    scale = ((hi - lo) / LEVELS).clamp_min(_SCALE_FLOOR).to(scale_dtype).float()  # as stored
    zero = torch.round(-lo / scale).clamp(0, LEVELS)
    codes = (torch.round(g / scale) + zero).clamp(0, LEVELS)
    return scale, zero, codes


# ----------------------------------------------------------------------------- the real version


@dataclass
class Int4Tensor:
    """A (d_out, d_in) weight in group-wise int4."""

    packed: torch.Tensor  # (d_out * d_in / 2,) uint8: two codes per byte, high nibble first
    scale: torch.Tensor  # (d_out, d_in / group) fp16
    zero: torch.Tensor  # (d_out, d_in / group) uint8, in 0..15
    shape: torch.Size  # (d_out, d_in)
    group: int  # input features per (scale, zero)
    dtype: torch.dtype  # the original dtype: what dequantize_int4 returns by default

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, clip: torch.Tensor | None = None) -> Int4Tensor:
    """w (d_out, d_in) float -> Int4Tensor (bytes: int4_bytes_for(w.shape, group))."""
    scale, zero, codes = _int4_codes(w, group, clip)
    packed = pack_nibbles(codes.to(torch.uint8))  # (n/2,)
    return Int4Tensor(packed, scale.squeeze(2).half(), zero.squeeze(2).to(torch.uint8), w.shape, group, w.dtype)


_LEVELS = torch.arange(16, dtype=torch.float32)  # the codes as floats: a byte hi*16+lo looks up (hi, lo)
pair_table("int4", _LEVELS, torch.device("cpu"))  # built at import: made inside a measurement, it would count


def dequantize_int4(q: Int4Tensor, dtype: torch.dtype | None = None,
                    input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Int4Tensor -> the (d_out, d_in) weight in `dtype` (default the original), computed in fp32:
    (code - zero) * scale per group, then, with AWQ's kept input_scale s (d_in,), each column divided by s.

    One lookup per byte with int32 indices: peak INT4_DEQUANT_BYTES_PER_WEIGHT = 6 bytes per weight
    (the 2-byte index beside the 4-byte result; or the result and its 16-bit copy)."""
    d_out, d_in = q.shape
    w = pair_table("int4", _LEVELS, q.packed.device).index_select(0, q.packed.reshape(-1).int())  # (n/2, 2) fp32
    g = w.view(d_out, d_in // q.group, q.group)
    g.sub_(q.zero.float()[..., None]).mul_(q.scale.float()[..., None])  # in place
    w = w.view(d_out, d_in)
    if input_scale is not None:
        w.div_(input_scale.float())  # (d_in,) broadcast over rows: W = Q(W s) / s
    return w.to(q.dtype if dtype is None else dtype)


def int4_codes(q: Int4Tensor) -> torch.Tensor:
    """The (d_out, d_in) uint8 codes 0..15, unpacked (for inspection and tests)."""
    return unpack_nibbles(q.packed).view(q.shape)


# ----------------------------------------------------------------------------- the layer


class Int4Linear(nn.Module):
    """A frozen nn.Linear stored in group-wise int4 (+ optionally AWQ's input scale), dequantized on the fly.

    With input_scale s the stored weight is Q(W diag(s)) and the layer computes x (Q(W diag(s)) / s)^T:
    the same as (x / s) Q(W s)^T, without an activation-sized temporary. bytes: int4_bytes_for(shape,
    group, input_scale is not None); nothing weight-sized is kept for backward (labkit.quant.matmul)."""

    def __init__(self, q: Int4Tensor, bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None, keep_dequantized: bool = False):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_packed", q.packed)  # (n/2,) uint8
        self.register_buffer("weight_scale", q.scale)  # (d_out, d_in/group) fp16
        self.register_buffer("weight_zero", q.zero)  # (d_out, d_in/group) uint8
        self.register_buffer("input_scale", input_scale)  # (d_in,) fp16 AWQ scale, or None
        self.group, self.weight_dtype = q.group, q.dtype
        self.compute_dtype = compute_dtype  # None: the input's dtype
        self.keep_dequantized = keep_dequantized
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = INT4_GROUP, input_scale: torch.Tensor | None = None,
                    clip: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                    keep_dequantized: bool = False) -> "Int4Linear":
        """Round-to-nearest int4 of linear.weight; with input_scale s (d_in,), of weight * s (s kept in fp16)."""
        w = linear.weight.detach()
        check_group(w.shape[1], group, "this Linear")
        s = None
        if input_scale is not None:
            if input_scale.shape != (w.shape[1],):
                raise ValueError(f"input_scale must have one value per input feature ({w.shape[1]}), "
                                 f"got shape {tuple(input_scale.shape)}")
            s = input_scale.detach().half()
            w = w.float() * s.float()
        q = quantize_int4(w, group, clip)
        q.dtype = linear.weight.dtype
        return cls(q, linear.bias, s, compute_dtype, keep_dequantized)

    @property
    def quantized_weight(self) -> Int4Tensor:
        return Int4Tensor(self.weight_packed, self.weight_scale, self.weight_zero,
                          torch.Size((self.out_features, self.in_features)), self.group, self.weight_dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_int4(self.quantized_weight, dtype, self.input_scale)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, scales, zero points and AWQ scale (the bias not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.weight_packed, self.weight_scale, self.weight_zero,
                                                           self.input_scale) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_linear(x, self.dequantized_weight, self.bias, self.compute_dtype, self.keep_dequantized)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group={self.group}, awq_scale={self.input_scale is not None}, compute_dtype={self.compute_dtype}"
                + (", keep_dequantized=True" if self.keep_dequantized else ""))
