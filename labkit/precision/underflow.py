"""Measure gradient underflow: the share of values a cast to fp16 (or bf16) flushes to zero, with and without loss scaling.

fp16 has 5 exponent bits: its smallest subnormal is 2**-24 (6e-8), and anything at or below half of
it, 2**-25, rounds to zero. Its largest value is 65504: anything bigger becomes inf. bf16 has fp32's
8 exponent bits (smallest subnormal 2**-133), so real gradients practically never flush in bf16.
Multiplying by a loss scale S moves every value up by log2(S) binades: fewer flush, more may overflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or the torch dtype), got {dtype!r}")


def _scale(scale) -> float:
    try:
        s = float(scale)
    except (TypeError, ValueError):
        s = float("nan")
    if not (s > 0 and s != float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return s


def _cast(tensor: torch.Tensor, dtype, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(nonzero mask of tensor, (tensor * scale) cast to dtype); the product is taken in fp64 so that
    only the cast, never the scaling, can round."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"tensor must be a floating-point torch.Tensor, got {type(tensor).__name__}")
    x = tensor.detach().to(torch.float64)
    return x != 0, (x * _scale(scale)).to(_dtype(dtype))


def flush_fraction(tensor: torch.Tensor, dtype="fp16", scale: float = 1.0) -> float:
    """Fraction of the nonzero values of `tensor` that become 0 when tensor*scale is cast to dtype."""
    nonzero, low = _cast(tensor, dtype, scale)
    n = int(nonzero.sum())
    return float((nonzero & (low == 0)).sum()) / n if n else 0.0


def overflow_fraction(tensor: torch.Tensor, dtype="fp16", scale: float = 1.0) -> float:
    """Fraction of the finite values of `tensor` that become inf/nan when tensor*scale is cast to dtype.
    (The fp8 dtypes saturate or give nan: see labkit.precision.fp8, which scales before it casts.)"""
    _, low = _cast(tensor, dtype, scale)
    finite = torch.isfinite(tensor.detach())
    n = int(finite.sum())
    return float((finite & ~torch.isfinite(low)).sum()) / n if n else 0.0


# ---- real gradients ---------------------------------------------------------------------------------
@dataclass
class UnderflowReport:
    """What casting a model's real (fp32) gradients to 16 bits would lose."""

    n_values: int  # nonzero gradient elements, over all parameters
    fp16: dict[float, float] = field(default_factory=dict)  # loss scale -> fraction flushed to zero in fp16
    fp16_overflow: dict[float, float] = field(default_factory=dict)  # loss scale -> fraction become inf
    bf16: float = 0.0  # fraction flushed to zero in bf16 (no scaling)
    log2_abs: torch.Tensor | None = None  # log2|g| of the nonzero gradients, for a histogram

    def rows(self) -> list[tuple[str, float, float]]:
        """(setting, flushed, overflowed) rows for a table."""
        out = [(f"fp16 x {s:g}", f, self.fp16_overflow[s]) for s, f in self.fp16.items()]
        return out + [("bf16 x 1", self.bf16, 0.0)]


def gradient_underflow_report(model: torch.nn.Module, loss: torch.Tensor,
                              scales=(1.0, 2.0**8, 2.0**16)) -> UnderflowReport:
    """Take d loss / d params (fp32 model, fp32 gradients: .grad is left alone) and report, over all of
    them, the fraction fp16 flushes at each loss scale, the fraction that would overflow, and bf16's.

    This emulates the last cast only (gradient -> 16 bits); in real fp16 training the activation
    gradients are 16-bit too, so the true loss is at least this. Every scale is checked.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ValueError("loss must be a scalar tensor that requires grad (the model's loss)")
    scales = tuple(_scale(s) for s in scales)
    if not scales:
        raise ValueError("scales must name at least one loss scale")
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads if g is not None])  # (N,)
    nonzero = flat[flat != 0]
    rep = UnderflowReport(n_values=nonzero.numel(), log2_abs=nonzero.abs().log2())
    for s in scales:
        rep.fp16[s] = flush_fraction(nonzero, torch.float16, s)
        rep.fp16_overflow[s] = overflow_fraction(nonzero, torch.float16, s)
    rep.bf16 = flush_fraction(nonzero, torch.bfloat16)
    return rep
