"""NF4 (4-bit NormalFloat) blockwise weights with double quantization, as QLoRA stores its frozen base model.

Each block of 64 weights is divided by its absmax and every value replaced by the index (0..15) of
the nearest of 16 NF4 levels, two indices per byte, the first in the high nibble. Double
quantization then stores the per-block absmax values themselves in 8 bits: subtract their mean, quantize
blockwise 256 with the signed 8-bit dynamic map, keep one fp32 absmax per 256 blocks.
Bits per parameter: 4 + 32/64 = 4.5 without; 4 + 8/64 + 32/(64*256) = 4.127 with double quantization.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .dynamic import dequantize_blockwise, dynamic_map, midpoints, quantize_blockwise, quantize_blockwise_
from .int8 import _TINY
from .matmul import dequant_linear

# The 16 NF4 levels as the QLoRA paper (Dettmers et al. 2023) lists them, rounded to float32 as bitsandbytes ships them:
# 7 negative, 0, 8 positive. normal_float_map() derives them; it agrees to within 1.2e-7.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])  # fmt: skip
NF4_BLOCKSIZE = 64  # weights per absmax (QLoRA's and bitsandbytes' default)
DOUBLE_QUANT_BLOCKSIZE = 256  # absmax values per second-level fp32 scale
_DYNAMIC_MAP = dynamic_map(signed=True)  # the 256 levels for the absmax values, built once
# Dequantizing one weight (dequantize_nf4) holds, at its worst moment, the int32 byte index (4 B per 2
# weights) beside the fp32 result (4 B), or the fp32 result and its 16-bit copy (2 B): 6 B per weight.
# (It was 13 with per-weight int64 indices: change it here if dequantize_nf4 changes.)
NF4_DEQUANT_BYTES_PER_WEIGHT = 6


def nf4_bytes_for(n: int, blocksize: int = NF4_BLOCKSIZE, double_quant: bool = True) -> int:
    """Bytes of one weight of n values in NF4 (what quantize_nf4 keeps; n divisible by blocksize), b = n/blocksize:

        n/2 + b + 4*ceil(b/256) + 4   with double quantization: packed 4-bit codes, one uint8 absmax code
                                      per block, one fp32 scale per 256 absmax values, one fp32 offset
        n/2 + 4b                      without: an fp32 absmax per block

    ~0.5159 bytes (4.127 bits) per weight at blocksize 64 with double quantization, 0.5625 (4.5) without.
    Source: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (section 3, double
    quantization); bitsandbytes' quantize_4bit (blocksize 64, compress_statistics)."""
    blocks = n // blocksize
    if not double_quant:
        return n // 2 + 4 * blocks
    return n // 2 + blocks + 4 * math.ceil(blocks / DOUBLE_QUANT_BLOCKSIZE) + 4


def normal_float_map(offset: float = 0.9677083) -> torch.Tensor:
    """16 levels at quantiles of N(0, 1), scaled to [-1, 1]: 8 positive quantiles spread evenly in
    probability from 0.5 to `offset` (the largest), 7 negative ones likewise, and an exact 0.
    Equal probability per level is what makes it good for normally distributed weights."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])  # 8 values > 0
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])  # 7 values < 0
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return (levels / levels.max()).float()


# ----------------------------------------------------------------------------- teaching version


def quantize_nf4_toy(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block -> (indices 0..15 as uint8, one per value, fp32 absmax): brute-force nearest level."""
    absmax = block.abs().max().float()
    normed = block.float() / absmax.clamp_min(_TINY)  # in [-1, 1]
    idx = (normed[..., None] - NF4_CODE).abs().argmin(dim=-1)  # (..., 16) distances -> nearest
    return idx.to(torch.uint8), absmax


def dequantize_nf4_toy(idx: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    return NF4_CODE[idx.long()] * absmax


# ----------------------------------------------------------------------------- packing


def pack_nibbles(idx: torch.Tensor) -> torch.Tensor:
    """(n,) indices 0..15 (n even) -> (n/2,) uint8: element 2i in the high nibble, 2i+1 in the low one."""
    idx = idx.reshape(-1).to(torch.uint8)
    return (idx[0::2] << 4) | idx[1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(n/2,) uint8 -> (n,) uint8 indices, inverse of pack_nibbles."""
    packed = packed.reshape(-1)
    return torch.stack([packed >> 4, packed & 0x0F], dim=1).view(-1)


# ----------------------------------------------------------------------------- the real version


@dataclass
class NF4State:
    """What dequantize_nf4 needs besides the packed codes (bitsandbytes calls it QuantState)."""

    absmax: torch.Tensor  # (blocks,) fp32, or uint8 dynamic-map codes when double-quantized
    shape: torch.Size  # of the original weight
    dtype: torch.dtype  # of the original weight: what dequantize_nf4 returns by default
    blocksize: int = NF4_BLOCKSIZE  # weights per absmax
    absmax_scale: torch.Tensor | None = None  # (ceil(blocks / 256),) fp32: second-level absmax
    absmax_offset: torch.Tensor | None = None  # () fp32: the mean subtracted before quantizing absmax

    @property
    def double_quant(self) -> bool:
        return self.absmax_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.absmax, self.absmax_scale, self.absmax_offset) if t is not None]

    def block_absmax(self) -> torch.Tensor:
        """(blocks,) fp32 absmax per block, undoing double quantization if there is one."""
        if not self.double_quant:
            return self.absmax.float()
        absmax = dequantize_blockwise(self.absmax, self.absmax_scale, _DYNAMIC_MAP, DOUBLE_QUANT_BLOCKSIZE)
        return absmax + self.absmax_offset


def _check_blocksize(w: torch.Tensor, blocksize: int) -> None:
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 2 or blocksize % 2:
        raise ValueError(f"blocksize must be an even integer >= 2 (bitsandbytes allows 32..4096), got {blocksize!r}")
    if w.numel() % blocksize:
        raise ValueError(f"blocksize {blocksize} does not divide the weight's {w.numel()} values: "
                         "choose one that does (64 divides every hidden size that is a multiple of 64)")


def quantize_nf4(w: torch.Tensor, blocksize: int = NF4_BLOCKSIZE, double_quant: bool = True
                 ) -> tuple[torch.Tensor, NF4State]:
    """w (float, any shape) -> (packed uint8 codes of shape (numel/2,), NF4State).

    Blockwise absmax quantization (labkit.quant.dynamic.quantize_blockwise_) with the 16 NF4 levels as
    the codes: each block divided by its absmax, each value to the nearest level (a tie to the lower).
    bytes: nf4_bytes_for(numel, blocksize, double_quant)."""
    if not w.is_floating_point():
        raise TypeError(f"NF4 quantization takes a floating-point tensor, got {w.dtype}")
    _check_blocksize(w, blocksize)
    flat = w.detach().reshape(-1).to(torch.float32, copy=True)  # normalised in place
    absmax = torch.empty(flat.numel() // blocksize, dtype=torch.float32, device=w.device)  # (blocks,) fp32
    idx = torch.empty(flat.numel(), dtype=torch.uint8, device=w.device)
    quantize_blockwise_(flat, idx, absmax, midpoints(NF4_CODE.to(w.device)), blocksize)
    del flat
    packed = pack_nibbles(idx)  # (numel/2,) uint8
    if not double_quant:
        return packed, NF4State(absmax, w.shape, w.dtype, blocksize)
    offset = absmax.mean()  # absmax > 0: centring it gives the signed 8-bit map both halves to use
    qabsmax, absmax_scale = quantize_blockwise(absmax - offset, _DYNAMIC_MAP, DOUBLE_QUANT_BLOCKSIZE)
    return packed, NF4State(qabsmax, w.shape, w.dtype, blocksize, absmax_scale, offset)


_PAIR_TABLES: dict = {}  # (name, device) -> the (256, 2) table below, built once per device


def pair_table(name: str, levels: torch.Tensor, device) -> torch.Tensor:
    """(256, 2) fp32: for every byte hi*16+lo, the two levels it packs (levels[hi], levels[lo]), for the 16
    `levels` called `name` (NF4's, int4's)."""
    table = _PAIR_TABLES.get((name, device))
    if table is None:
        table = _PAIR_TABLES[name, device] = torch.stack([levels.repeat_interleave(16), levels.repeat(16)], 1).to(device)
    return table


pair_table("nf4", NF4_CODE, torch.device("cpu"))  # built at import: made inside a measurement, it would count


def dequantize_nf4(packed: torch.Tensor, state: NF4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed codes + NF4State -> the weight in its original shape, in `dtype` (default the original).
    The product level x absmax is taken in fp32 and then rounded to `dtype`.

    One lookup per byte (a 256-entry table of level pairs) with int32 indices: the temporaries are
    the (numel/2,) int32 byte indices (2 bytes per weight) next to the fp32 result (4 per weight),
    scaled in place; a 16-bit `dtype` adds its 2-byte copy. Peak: NF4_DEQUANT_BYTES_PER_WEIGHT = 6 bytes
    per weight (the result included).
    """
    packed = packed.reshape(-1).view(torch.uint8)
    if 2 * packed.numel() != state.shape.numel():
        raise ValueError(f"{2 * packed.numel()} packed codes do not fit the shape {tuple(state.shape)}")
    w = pair_table("nf4", NF4_CODE, packed.device).index_select(0, packed.int())  # (numel/2, 2) fp32; index int32, not int64
    w.view(-1, state.blocksize).mul_(state.block_absmax()[:, None])  # level x absmax, in place
    return w.view(state.shape).to(state.dtype if dtype is None else dtype)


def nbytes_nf4(packed: torch.Tensor, state: NF4State) -> int:
    """Bytes actually held by the packed codes and the statistics (the shared 16-level table not counted)."""
    return sum(t.numel() * t.element_size() for t in [packed, *state.tensors()])


def bits_per_param_nf4(packed: torch.Tensor, state: NF4State) -> float:
    return 8 * nbytes_nf4(packed, state) / state.shape.numel()


# ----------------------------------------------------------------------------- the layer


def nf4_linear(x: torch.Tensor, packed: torch.Tensor, state: NF4State, bias: torch.Tensor | None = None,
               compute_dtype: torch.dtype | None = None, keep_dequantized: bool = False) -> torch.Tensor:
    """F.linear(x, dequantize_nf4(packed, state), bias) in `compute_dtype` (default x's), returned in x's dtype;
    nothing weight-sized is saved for backward unless keep_dequantized (see labkit.quant.matmul)."""
    return dequant_linear(x, functools.partial(dequantize_nf4, packed, state), bias, compute_dtype, keep_dequantized)


class NF4Linear(nn.Module):
    """A frozen nn.Linear whose weight is stored in NF4 and dequantized on the fly in `compute_dtype`,
    as QLoRA's base layers (bitsandbytes Linear4bit with quant_type="nf4").

    bytes: about 0.52 per weight with double quantization, against 4 (fp32) or 2 (bf16). The
    dequantized (out, in) weight is a temporary of forward (and again of backward, see DequantMatmul):
    nothing weight-sized is kept for backward. keep_dequantized=True is the teaching version that
    lets autograd keep it (a full-size copy per layer until backward).
    """

    def __init__(self, packed: torch.Tensor, state: NF4State, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None, keep_dequantized: bool = False):
        super().__init__()
        if len(state.shape) != 2:
            raise ValueError(f"NF4Linear needs a 2-D (out, in) weight, got shape {tuple(state.shape)}")
        self.out_features, self.in_features = state.shape
        self.register_buffer("weight_packed", packed)  # (out*in/2,) uint8
        self.register_buffer("weight_absmax", state.absmax)  # (blocks,) fp32 or uint8
        self.register_buffer("weight_absmax_scale", state.absmax_scale)  # (ceil(blocks/256),) fp32 or None
        self.register_buffer("weight_absmax_offset", state.absmax_offset)  # () fp32 or None
        self.blocksize, self.weight_dtype = state.blocksize, state.dtype
        self.compute_dtype = compute_dtype  # None: the input's dtype
        self.keep_dequantized = keep_dequantized
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int = NF4_BLOCKSIZE, double_quant: bool = True,
                    compute_dtype: torch.dtype | None = None, keep_dequantized: bool = False) -> "NF4Linear":
        packed, state = quantize_nf4(linear.weight, blocksize, double_quant)
        return cls(packed, state, linear.bias, compute_dtype, keep_dequantized)

    @property
    def state(self) -> NF4State:
        return NF4State(self.weight_absmax, torch.Size((self.out_features, self.in_features)), self.weight_dtype,
                        self.blocksize, self.weight_absmax_scale, self.weight_absmax_offset)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.weight_packed, self.state, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight_packed, self.state, self.bias, self.compute_dtype, self.keep_dequantized)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocksize={self.blocksize}, double_quant={self.weight_absmax_scale is not None}, "
                f"compute_dtype={self.compute_dtype}" + (", keep_dequantized=True" if self.keep_dequantized else ""))
