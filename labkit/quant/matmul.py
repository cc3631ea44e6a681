"""A Linear on a frozen quantized weight, dequantized on the fly, that saves nothing weight-sized for backward.

The naive way, F.linear(x, dequantize(W)), lets autograd keep the dequantized (d_out, d_in) weight
until backward (it needs W for dL/dx): the full-precision weight comes back, layer by layer, as
saved activations. `DequantMatmul` (what bitsandbytes' MatMul4Bit does for Linear4bit) dequantizes
in forward and again in backward and keeps only a reference to the function that does it: one
layer's dequantized weight exists at a time; the price is a second dequantization per layer.
Used by labkit.quant's NF4Linear and Int8Linear (QLoRA's frozen bases).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Dequantize = Callable[[torch.dtype], torch.Tensor]  # dtype -> the (d_out, d_in) weight in that dtype


class DequantMatmul(torch.autograd.Function):
    """x W^T + b, W = dequantize(dtype) frozen; gradients for x and (if it requires grad) b only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, dequantize: Dequantize,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.dequantize, ctx.dtype = dequantize, dtype  # a reference to the layer's own codes: no bytes
        ctx.bias_dtype = None if bias is None else bias.dtype
        w = dequantize(dtype)  # (d_out, d_in) temporary, freed on return
        return F.linear(x, w, None if bias is None else bias.to(dtype))  # (..., d_out)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        gx = gb = None
        if ctx.needs_input_grad[0]:
            gx = g @ ctx.dequantize(ctx.dtype)  # (..., d_in); W again, freed at once
        if ctx.needs_input_grad[1]:
            gb = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)  # (d_out,)
        return gx, gb, None, None


def dequant_linear(x: torch.Tensor, dequantize: Dequantize, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype | None = None, keep_dequantized: bool = False) -> torch.Tensor:
    """F.linear(x, dequantize(dtype), bias) in `compute_dtype` (default x's dtype), returned in x's dtype.

    keep_dequantized: the teaching version, plain F.linear on the dequantized weight: autograd then
        saves that weight for backward, 4 (fp32) or 2 (bf16) bytes per weight per layer.
    """
    dtype = compute_dtype or x.dtype
    if keep_dequantized:
        b = None if bias is None else bias.to(dtype)
        return F.linear(x.to(dtype), dequantize(dtype), b).to(x.dtype)
    return DequantMatmul.apply(x.to(dtype), bias, dequantize, dtype).to(x.dtype)
