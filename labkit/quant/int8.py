"""Int8 weights, absmax (symmetric) or zero-point (asymmetric), per tensor, row or block, and a frozen Int8Linear.

A float tensor becomes 1 byte per value plus one fp32 scale (and, asymmetric, one uint8 zero point)
per group of values: the whole tensor, one output row (channel), or one block of `blocksize`.
    absmax:     scale = max|x| / 127           q = round(x / scale)             in [-127, 127] (int8)
    zero-point: scale = (max - min) / 255      q = round(x / scale) + zero      in [0, 255]    (uint8)
Bytes: 1 per weight + 4 per group (+1 per group with a zero point), e.g. per-row 384 x 384:
8 + 32/384 = 8.083 bits per parameter, against 32 for fp32 and 16 for bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .matmul import dequant_linear

MODES = ("absmax", "zeropoint")
GRANULARITIES = ("tensor", "channel", "block")
_TINY = torch.finfo(torch.float32).tiny  # guards 0 / 0 in all-zero groups
# Dequantizing one weight on the fly (dequantize_int8, as Int8Linear does), at its worst moment, by the
# compute dtype's bytes: fp32 (4) holds the codes as fp32 (4 B) and the scaled product (4 B); 16-bit (2)
# holds the fp32 copy of the codes (4 B) and its 16-bit cast (2 B). Change it here if dequantize_int8 changes.
INT8_DEQUANT_BYTES_PER_WEIGHT = {4: 8, 2: 6}


def int8_bytes_for(shape, mode: str = "absmax", granularity: str = "channel", blocksize: int | None = 64) -> int:
    """Bytes of one tensor in int8 (what quantize_int8 keeps), n = prod(shape) values in g groups:

        n + 4g      absmax: a 1-byte code per value + one fp32 scale per group
        n + 5g      zeropoint: the same + one uint8 zero point per group

    with g = 1 ("tensor"), shape[0] ("channel": one per output row of a weight) or n / blocksize ("block").
    Source: Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale"
    (absmax, vector-wise scales); Jacob et al. 2018, "Quantization and Training of Neural Networks for
    Efficient Integer-Arithmetic-Only Inference" (zero point)."""
    x = torch.empty(tuple(shape), device="meta")  # only for the argument checks: no storage
    _check_args(x, mode, granularity, blocksize)
    n = math.prod(shape)
    groups = {"tensor": 1, "channel": shape[0] if len(shape) else 0, "block": n // (blocksize or 1)}[granularity]
    return n + (5 if mode == "zeropoint" else 4) * groups

# ----------------------------------------------------------------------------- teaching version
# One scale for the whole tensor, four lines each. The real version below only adds groups.


def absmax_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (int8 codes in [-127, 127], fp32 scale): the largest magnitude maps to 127, zero stays exactly 0."""
    scale = x.abs().max().float() / 127
    return torch.round(x.float() / scale.clamp_min(_TINY)).to(torch.int8), scale


def absmax_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


def zeropoint_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> (uint8 codes in [0, 255], fp32 scale, uint8 zero point): the range [min, max] (stretched to
    hold 0, so that 0 is exact) is spread over all 256 codes; a lopsided range wastes none of them."""
    lo, hi = x.min().float().clamp(max=0), x.max().float().clamp(min=0)
    scale = (hi - lo) / 255
    zero = torch.round(-lo / scale.clamp_min(_TINY)).clamp(0, 255)
    codes = (torch.round(x.float() / scale.clamp_min(_TINY)) + zero).clamp(0, 255)
    return codes.to(torch.uint8), scale, zero.to(torch.uint8)


def zeropoint_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes.float() - zero.float()) * scale


# ----------------------------------------------------------------------------- the real version


@dataclass
class Int8Tensor:
    """A quantized tensor: everything needed to get the floats back."""

    codes: torch.Tensor  # int8 (absmax) or uint8 (zeropoint), the original shape; 1 byte per value
    scale: torch.Tensor  # fp32, one per group: (1,), (rows,) or (numel / blocksize,)
    zero_point: torch.Tensor | None  # uint8, one per group; None for absmax
    mode: str  # "absmax" | "zeropoint"
    granularity: str  # "tensor" | "channel" (one group per row, dim 0) | "block" (flat blocks)
    blocksize: int | None  # values per group for "block", else None
    dtype: torch.dtype  # the dtype the tensor had, which dequantize returns by default

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes actually held by the codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero_point) if t is not None)

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.codes.numel()


def _check_args(x: torch.Tensor, mode: str, granularity: str, blocksize: int | None) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown int8 mode {mode!r}: use one of {MODES}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}: use one of {GRANULARITIES}")
    if not x.is_floating_point():
        raise TypeError(f"int8 quantization takes a floating-point tensor, got {x.dtype}")
    if granularity == "channel" and x.dim() < 1:
        raise ValueError("per-channel quantization needs at least one dimension (rows are dim 0)")
    if granularity == "block":
        if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize <= 0:
            raise ValueError(f"blocksize must be a positive integer, got {blocksize!r}")
        if x.numel() % blocksize:
            raise ValueError(f"blocksize {blocksize} does not divide the tensor's {x.numel()} values: "
                             "choose one that does (e.g. a divisor of the last dimension)")


def _groups(x: torch.Tensor, granularity: str, blocksize: int | None) -> torch.Tensor:
    """x -> (groups, values per group), fp32: a view of the values that share one scale."""
    x = x.detach().float()
    if granularity == "tensor":
        return x.reshape(1, -1)
    if granularity == "channel":
        return x.reshape(x.shape[0], -1)
    return x.reshape(-1, blocksize)


def quantize_int8(x: torch.Tensor, mode: str = "absmax", granularity: str = "channel",
                  blocksize: int | None = 64) -> Int8Tensor:
    """x (float, any shape) -> Int8Tensor: `mode` absmax or zeropoint, one scale per tensor, row or block."""
    _check_args(x, mode, granularity, blocksize)
    g = _groups(x, granularity, blocksize)  # (G, n)
    if mode == "absmax":
        scale = g.abs().amax(dim=1) / 127  # (G,)
        codes = torch.round(g / scale.clamp_min(_TINY)[:, None]).clamp(-127, 127).to(torch.int8)
        zero = None
    else:
        lo, hi = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)  # the range always holds 0
        scale = (hi - lo) / 255
        safe = scale.clamp_min(_TINY)[:, None]
        zero_f = torch.round(-lo[:, None] / safe).clamp(0, 255)  # (G, 1)
        codes = (torch.round(g / safe) + zero_f).clamp(0, 255).to(torch.uint8)
        zero = zero_f.view(-1).to(torch.uint8)
    return Int8Tensor(codes.view(x.shape), scale, zero, mode, granularity,
                      blocksize if granularity == "block" else None, x.dtype)


def dequantize_int8(q: Int8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Int8Tensor -> floats of the original shape, in `dtype` (default: the original dtype).

    The arithmetic is done in `dtype` when it is a float type (as a layer dequantizing on the fly in
    bf16 would); scales are rounded to it first."""
    dtype = q.dtype if dtype is None else dtype
    g = _groups(q.codes, q.granularity, q.blocksize).to(dtype)  # (G, n), exact: |codes| <= 255
    if q.zero_point is not None:
        g = g - q.zero_point.to(dtype)[:, None]
    return (g * q.scale.to(dtype)[:, None]).view(q.codes.shape)


def quant_error(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """How far a reconstruction is from the original: max and mean absolute error, RMSE, RMSE relative
    to the RMS of x, and the signal-to-quantization-noise ratio in dB (higher is better; +6 dB per bit)."""
    x, x_hat = x.detach().double(), x_hat.detach().double()
    err = x_hat - x
    rmse = err.pow(2).mean().sqrt().item()
    rms = x.pow(2).mean().sqrt().item()
    return {
        "max_abs": err.abs().max().item(),
        "mean_abs": err.abs().mean().item(),
        "rmse": rmse,
        "rel_rmse": rmse / rms if rms else math.inf,
        "sqnr_db": 20 * math.log10(rms / rmse) if rmse else math.inf,
    }


# ----------------------------------------------------------------------------- the layer


class Int8Linear(nn.Module):
    """A frozen nn.Linear whose weight is stored as int8 codes + scales and dequantized on the fly.

    bytes: 1 per weight + 4 per scale (+1 per zero point), against 4 (fp32) or 2 (bf16) per weight;
    the dequantized weight is a temporary in `compute_dtype` of forward (and again of backward, see
    labkit.quant.matmul): nothing weight-sized is kept for backward. keep_dequantized=True is the
    teaching version that lets autograd keep it (a full-size copy per layer until backward).
    """

    def __init__(self, q: Int8Tensor, bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None,
                 keep_dequantized: bool = False):
        super().__init__()
        if q.codes.dim() != 2:
            raise ValueError(f"Int8Linear needs a 2-D (out, in) weight, got shape {tuple(q.codes.shape)}")
        self.out_features, self.in_features = q.codes.shape
        self.register_buffer("weight_codes", q.codes)  # (out, in) int8 / uint8
        self.register_buffer("weight_scale", q.scale)  # (groups,) fp32
        self.register_buffer("weight_zero_point", q.zero_point)  # (groups,) uint8, or None
        self.mode, self.granularity, self.blocksize, self.weight_dtype = q.mode, q.granularity, q.blocksize, q.dtype
        self.compute_dtype = compute_dtype  # None: the input's dtype
        self.keep_dequantized = keep_dequantized
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str = "absmax", granularity: str = "channel",
                    blocksize: int | None = 64, compute_dtype: torch.dtype | None = None,
                    keep_dequantized: bool = False) -> "Int8Linear":
        return cls(quantize_int8(linear.weight, mode, granularity, blocksize), linear.bias, compute_dtype,
                   keep_dequantized)

    @property
    def quantized_weight(self) -> Int8Tensor:
        return Int8Tensor(self.weight_codes, self.weight_scale, self.weight_zero_point, self.mode,
                          self.granularity, self.blocksize, self.weight_dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_int8(self.quantized_weight, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_linear(x, self.dequantized_weight, self.bias, self.compute_dtype, self.keep_dequantized)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode}, granularity={self.granularity}, compute_dtype={self.compute_dtype}"
                + (", keep_dequantized=True" if self.keep_dequantized else ""))
