"""FP8 from scratch: scale, saturate and cast to e4m3/e5m2 per tensor, row or block, and a Linear whose GEMM runs in FP8.

An fp8 number has 1 byte: e4m3 (max 448, smallest subnormal 2**-9) for weights and activations,
e5m2 (max 57344, 2**-16) for gradients. So few bits need a scale per group of values:

    s  = fp8_max / max(amax(group), 1e-12)     # fp32 quantization scale, one per group
    x8 = saturate(x * s).to(fp8)               # clamp to +-fp8_max, then round
    x  ~ x8.float() / s                        # dequantize

A group can be the whole tensor (torchao's tensorwise recipe), a row (rowwise: a token of an
activation, an output channel of a weight), or a block: DeepSeek-V3 uses 1x128 activation tiles and
128x128 weight blocks. One outlier sets the scale of its whole group, so every small value in that
group is pushed towards (or below) e4m3's smallest subnormal: the smaller the group, the fewer lost.

FP8 buys speed (an FP8 GEMM runs at twice the bf16 rate on Ada/Hopper), not memory: the weights and
the master copy stay in high precision, and the fp8 copies come on top (`fp8_memory_report`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}  # dtype, max
GRANULARITIES = ("tensor", "row", "block")
KERNELS = ("emulate", "scaled_mm")
ACT_BLOCK, WEIGHT_BLOCK = (1, 128), (128, 128)  # DeepSeek-V3: per token per 128 channels; 128x128
AMAX_FLOOR = 1e-12  # an all-zero group gets a finite scale


def _format(fmt: str) -> tuple[torch.dtype, float]:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def _block(granularity: str, block, shape: tuple[int, int]) -> tuple[int, int]:
    """The (rows, cols) group of a 2-D view of shape `shape`; checks the arguments."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if granularity != "block":
        if block is not None:
            raise ValueError(f"block is only used with granularity='block', got block={block!r}")
        return shape if granularity == "tensor" else (1, shape[1])
    block = ACT_BLOCK if block is None else block
    if not (isinstance(block, (tuple, list)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be a pair of positive ints such as (1, 128) or (128, 128), got {block!r}")
    if shape[0] % block[0] or shape[1] % block[1]:
        raise ValueError(f"block {tuple(block)} must divide the (rows, cols) = {shape} of the tensor")
    return tuple(block)


def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", block=None):
    """x -> (x8, scale). x8 has x's shape in fp8; scale is fp32: () tensorwise, (..., 1) rowwise, or
    (rows/br, cols/bc) for blocks (br, bc) of x viewed as 2-D (rows = all leading dims, cols = last).
    block defaults to (1, 128). bytes: 1 per element + 4 per group."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        what = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating-point tensor with at least one dimension, got a {what}")
    dtype, fmax = _format(fmt)
    x2 = x.detach().reshape(-1, x.shape[-1])  # (M, K)
    M, K = x2.shape
    br, bc = _block(granularity, block, (M, K))
    groups = x2.float().view(M // br, br, K // bc, bc)  # (M/br, br, K/bc, bc)
    amax = groups.abs().amax(dim=(1, 3), keepdim=True)  # (M/br, 1, K/bc, 1)
    s = fmax / amax.clamp(min=AMAX_FLOOR)
    x8 = (groups * s).clamp(-fmax, fmax).to(dtype).view(x.shape)  # saturate, then round to fp8
    s = s.view(M // br, K // bc)
    if granularity == "tensor":
        s = s.reshape(())
    elif granularity == "row":
        s = s.view(*x.shape[:-1], 1)
    return x8, s


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x8.float() / scale, broadcasting a tensorwise, rowwise or blockwise scale back over x8."""
    if x8.dtype not in (d for d, _ in FORMATS.values()):
        raise ValueError(f"x8 must be float8_e4m3fn or float8_e5m2, got {x8.dtype}")
    if scale.dim() == 0 or scale.shape == (*x8.shape[:-1], 1):
        return (x8.float() / scale).to(dtype)
    x2 = x8.reshape(-1, x8.shape[-1])
    (M, K), (gr, gc) = x2.shape, scale.shape
    if scale.dim() != 2 or M % gr or K % gc:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not tile x8 of shape {tuple(x8.shape)}")
    out = x2.float().view(gr, M // gr, gc, K // gc) / scale.view(gr, 1, gc, 1)
    return out.view(x8.shape).to(dtype)


def fp8_error(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", block=None) -> float:
    """Relative error of a round trip: ||dequantize(quantize(x)) - x|| / ||x|| (Frobenius)."""
    y = dequantize_fp8(*quantize_fp8(x, fmt, granularity, block))
    x = x.detach().float()
    return float((y - x).norm() / x.norm().clamp(min=AMAX_FLOOR))


def outlier_demo(rows: int = 256, cols: int = 256, outlier: float = 1e4, fmt: str = "e4m3", seed: int = 0) -> dict:
    """Round-trip randn(rows, cols) with one entry set to `outlier` at each granularity. Returns
    {name: {"error": relative error of all values (fp8_error), "error_small": mean |relative error| of the
    values other than the outlier, "flushed": the fraction of them that became 0}}."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[rows // 3, cols // 5] = outlier
    small = torch.ones_like(x, dtype=torch.bool)
    small[rows // 3, cols // 5] = False
    out = {}
    for name, gran, block in (("tensor", "tensor", None), ("row", "row", None),
                              ("block 1x128", "block", ACT_BLOCK), ("block 128x128", "block", WEIGHT_BLOCK)):
        y = dequantize_fp8(*quantize_fp8(x, fmt, gran, block))
        e = y - x
        out[name] = {"error": float(e.norm() / x.norm()), "error_small": float((e[small] / x[small]).abs().mean()),
                     "flushed": float(((y == 0) & (x != 0) & small).sum()) / int(small.sum())}
    return out


# ---- an FP8 Linear ----------------------------------------------------------------------------------
@dataclass
class FP8Recipe:
    """How FP8Linear quantizes its GEMM's two inputs (the output and the backward stay high precision)."""

    activation: str = "row"  # "tensor", "row" (per token) or "block" (1x128 tiles, DeepSeek-V3)
    weight: str = "tensor"  # "tensor", "row" (per output channel) or "block" (128x128, DeepSeek-V3)
    fmt: str = "e4m3"  # fp8 format of both (DeepSeek-V3: e4m3 everywhere)
    kernel: str = "emulate"  # "emulate": dequantize + fp32 matmul, any device; "scaled_mm": SM89+ GPU

    def __post_init__(self) -> None:
        for name in ("activation", "weight"):
            if getattr(self, name) not in GRANULARITIES:
                raise ValueError(f"{name} must be one of {', '.join(GRANULARITIES)}, got {getattr(self, name)!r}")
        _format(self.fmt)
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")

    def blocks(self) -> tuple:
        return (ACT_BLOCK if self.activation == "block" else None, WEIGHT_BLOCK if self.weight == "block" else None)


def fp8_gemm_available(device) -> bool:
    """torch._scaled_mm runs on CUDA devices of compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_fp8(x8, sx, w8, sw, recipe: FP8Recipe, out_dtype=torch.bfloat16) -> torch.Tensor:
    """y = x @ w.t() from fp8 x8 (M, K) and w8 (N, K) with torch._scaled_mm, whose scales are the
    reciprocal (dequantization) scales: scalars, or (M, 1) and (1, N) rowwise. Blocks along K are
    done as one rowwise GEMM per 128 columns, accumulated in fp32 (DeepSeek-V3's promotion)."""
    (M, K), N = x8.shape, w8.shape[0]
    if K % 16 or N % 16:
        raise ValueError(f"torch._scaled_mm needs in_features and out_features divisible by 16, got {K}, {N}")
    pad = -M % 16  # M must be a multiple of 16 too: pad with zero rows
    if pad:
        x8 = torch.cat([x8.view(torch.uint8), x8.new_zeros(pad, K, dtype=torch.uint8)]).view(x8.dtype)
        sx = sx if sx.dim() == 0 else torch.cat([sx, sx.new_ones(pad, sx.shape[1])])
    ia, ib = 1.0 / sx, 1.0 / sw  # dequantization scales
    if recipe.activation == recipe.weight == "tensor":
        return torch._scaled_mm(x8, w8.t(), scale_a=ia, scale_b=ib, out_dtype=out_dtype)[:M]

    def a_scale(cols: slice) -> torch.Tensor:  # (M, 1)
        if recipe.activation == "block":
            return ia[:, cols.start // 128: cols.start // 128 + 1].contiguous()
        return ia.expand(M + pad, 1).contiguous()

    def b_scale(cols: slice) -> torch.Tensor:  # (1, N)
        if recipe.weight == "block":
            return ib[:, cols.start // 128].repeat_interleave(128)[None, :].contiguous()
        return (ib.view(1, N) if recipe.weight == "row" else ib.expand(1, N)).contiguous()

    step = 128 if "block" in (recipe.activation, recipe.weight) else K
    y = torch.zeros(M + pad, N, dtype=torch.float32, device=x8.device)
    for k in range(0, K, step):
        cols = slice(k, k + step)  # rowwise scaling needs a bf16 output; we add the pieces in fp32
        y += torch._scaled_mm(x8[:, cols].contiguous(), w8[:, cols].contiguous().t(), scale_a=a_scale(cols),
                              scale_b=b_scale(cols), out_dtype=torch.bfloat16).float()
    return y[:M].to(out_dtype)


class _FP8Matmul(torch.autograd.Function):
    """y = x @ w.t() with both quantized to fp8 in the forward. The backward is straight-through: it
    treats the quantization as identity and computes dx = dy @ w and dw = dy.t() @ x in the inputs'
    own (high) precision, from the saved high-precision x and w, which the layer had anyway."""

    @staticmethod
    def forward(ctx, x2, weight, recipe):  # x2 (M, K), weight (N, K) -> (M, N)
        ctx.save_for_backward(x2, weight)
        ablock, wblock = recipe.blocks()
        x8, sx = quantize_fp8(x2, recipe.fmt, recipe.activation, ablock)  # bytes: M*K + 4 per group
        w8, sw = quantize_fp8(weight, recipe.fmt, recipe.weight, wblock)  # bytes: N*K + 4 per group
        if recipe.kernel == "scaled_mm":
            return scaled_mm_fp8(x8, sx, w8, sw, recipe, out_dtype=x2.dtype)
        return (dequantize_fp8(x8, sx) @ dequantize_fp8(w8, sw).t()).to(x2.dtype)  # fp32 accumulate

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x2 if ctx.needs_input_grad[1] else None
        return dx, dw, None


class FP8Linear(nn.Linear):
    """nn.Linear whose forward GEMM runs on e4m3 inputs (emulated, or torch._scaled_mm on SM89+).
    Weights, bias, gradients and output keep the layer's dtype; the bias is added after the GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: FP8Recipe | None = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = _checked(recipe or FP8Recipe(), in_features, out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe | None = None) -> "FP8Linear":
        """The same Parameter objects (tied weights stay tied) in an FP8Linear."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe = _checked(recipe or FP8Recipe(), linear.in_features, linear.out_features)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe.kernel == "scaled_mm" and not fp8_gemm_available(x.device):
            raise RuntimeError(f"FP8 GEMMs (torch._scaled_mm) need an Ada/Hopper GPU (compute capability >= 8.9), "
                               f"not {x.device}; use FP8Recipe(kernel='emulate')")
        y = _FP8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self.recipe)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        r = self.recipe
        return f"{super().extra_repr()}, fp8={r.fmt}, activation={r.activation}, weight={r.weight}, kernel={r.kernel}"


def _checked(recipe: FP8Recipe, in_features: int, out_features: int) -> FP8Recipe:
    if not isinstance(recipe, FP8Recipe):
        raise ValueError(f"recipe must be an FP8Recipe, got {type(recipe).__name__}")
    if "block" in (recipe.activation, recipe.weight) and in_features % 128:
        raise ValueError(f"block scaling needs in_features divisible by 128, got {in_features}")
    if recipe.weight == "block" and out_features % 128:
        raise ValueError(f"128x128 weight blocks need out_features divisible by 128, got {out_features}")
    if recipe.kernel == "scaled_mm" and (in_features % 16 or out_features % 16):
        raise ValueError(f"kernel='scaled_mm' needs in_features and out_features divisible by 16, "
                         f"got {in_features}, {out_features}")
    return recipe


def swap_to_fp8(model: nn.Module, recipe: FP8Recipe | None = None, filter_fn=None) -> nn.Module:
    """Replace every nn.Linear (for which filter_fn(name, module) is true) by an FP8Linear, in place."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and (filter_fn is None or filter_fn(full, child)):
                setattr(mod, child_name, FP8Linear.from_linear(child, recipe))
    return model


@dataclass
class FP8MemoryReport:
    """Ledger peaks of one forward+backward of the same model, bf16 Linear vs FP8Linear."""

    bf16: object  # labkit.memory.Measurement
    fp8: object

    @property
    def peaks(self) -> dict[str, int]:
        return {"bf16": self.bf16.peak.total, "fp8": self.fp8.peak.total}


def fp8_memory_report(model: nn.Module, *inputs, recipe: FP8Recipe | None = None,
                      dtype: torch.dtype = torch.bfloat16) -> FP8MemoryReport:
    """Measure (labkit.memory.Ledger) one forward+backward of copies of `model` in `dtype`, with its
    Linears as they are and swapped to FP8Linear. The loss is the output if it is a scalar, else its sum."""
    from labkit.memory import Ledger

    out = {}
    for name in ("bf16", "fp8"):
        m = copy.deepcopy(model).to(dtype)
        if name == "fp8":
            swap_to_fp8(m, recipe)
        args = [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in inputs]
        with Ledger(m, label=f"{name} forward+backward") as led:
            y = m(*args)
            (y if y.numel() == 1 else y.sum()).backward()
            del y
        out[name] = led.measurement()
    return FP8MemoryReport(**out)
