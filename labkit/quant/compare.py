"""Bits against error for one weight matrix: the figures lesson 07's panels draw.

`quantize_report` quantizes a weight with one of the int8 / NF4 modes at one block size; `awq_report`
puts it in group-wise int4 by round-to-nearest or with AWQ's activation-aware scale (and clip), given
the input statistics of its layer.
"""

from __future__ import annotations

import torch

from .awq import InputStats, awq_scale, search_clip, search_scale
from .int4 import fake_quantize_int4, int4_bytes_for
from .int8 import dequantize_int8, quant_error, quantize_int8
from .nf4 import bits_per_param_nf4, dequantize_nf4, quantize_nf4

QUANT_MODES = ("int8 absmax", "int8 zero-point", "NF4", "NF4 + double quant")
QUANT_BLOCKS = (32, 64, 128, 256, 512, 1024, 4096)
INT4_METHODS = ("int4 RTN", "int4 AWQ", "int4 AWQ + clip")
INT4_GROUPS = (32, 64, 128, 256, 512)


def quantize_report(w: torch.Tensor, mode: str, blocksize: int) -> tuple[float, float]:
    """-> (bits per parameter, relative RMSE) of w quantized with `mode` (one of QUANT_MODES) in blocks of
    `blocksize`."""
    if mode not in QUANT_MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(QUANT_MODES)}")
    if mode.startswith("int8"):
        q = quantize_int8(w, "absmax" if mode == "int8 absmax" else "zeropoint", "block", blocksize)
        return q.bits_per_param, quant_error(w, dequantize_int8(q))["rel_rmse"]
    p, s = quantize_nf4(w, blocksize, double_quant=mode.endswith("double quant"))
    return bits_per_param_nf4(p, s), quant_error(w, dequantize_nf4(p, s))["rel_rmse"]


def awq_report(w: torch.Tensor, stats: InputStats, method: str, group: int,
               scale_kept: bool = True) -> tuple[float, float, float, list[float]]:
    """-> (bits per weight, output MSE relative to RTN's, alpha, the alpha grid's errors) of w in int4 with
    `method` (one of INT4_METHODS) in groups of `group`. scale_kept: AWQ's scale stays in the layer (2 bytes
    per input feature) because it cannot be folded into the previous operation (e.g. after a GELU)."""
    if method not in INT4_METHODS:
        raise ValueError(f"method {method!r}: choose one of {', '.join(INT4_METHODS)}")
    res = search_scale([w], stats, group)
    alpha = 0.0 if method == "int4 RTN" else res.alpha
    s = awq_scale(stats.mean_abs, alpha).half().float()
    clip = search_clip(w * s, stats.scaled(s), group) if method.endswith("clip") else None
    w_hat = fake_quantize_int4(w * s, group, clip) / s
    d = w_hat - w
    mse = ((d @ stats.gram) * d).sum().item() / w.shape[0]
    kept = scale_kept and method != "int4 RTN"
    bits = 8 * int4_bytes_for(w.shape, group, kept) / w.numel()
    return bits, mse / res.rtn_error, alpha, res.errors
