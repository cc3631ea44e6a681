"""The 8-bit dynamic ("tree") map and blockwise absmax quantization, as 8-bit optimizers and NF4's
double quantization use them.

Each block of `blocksize` values is divided by its largest magnitude (absmax), so it lies in
[-1, 1], and every value is replaced by the index of the nearest of 256 code values. The dynamic map
spends its codes like a float: one decade per exponent step, from about 1e-6 up to 1, finer near 1.
Storage: 1 byte per value + 4 bytes (fp32 absmax) per block, e.g. 2.03 bytes/param for Adam's m+v.
"""

from __future__ import annotations

import torch


def dynamic_map(signed: bool = True, exponent_steps: int = 7) -> torch.Tensor:
    """256 sorted fp32 codes: for decade i (0..6), 2**i (signed) or 2**(i+1) (unsigned) values spread
    linearly over [0.1, 1) x 10**(i-6) at bin midpoints, their negatives if signed, then 0 and 1."""
    values = []
    for i in range(exponent_steps):
        k = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, k + 1, dtype=torch.float64)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - (exponent_steps - 1))
        values.append(mids)
        if signed:
            values.append(-mids)
    values.append(torch.tensor([0.0, 1.0], dtype=torch.float64))
    code = torch.cat(values).sort().values.float()
    if code.numel() != 256:
        raise ValueError(f"exponent_steps={exponent_steps} does not give 256 codes ({code.numel()})")
    return code


def _check(blocksize: int) -> None:
    if not isinstance(blocksize, int) or blocksize <= 0:
        raise ValueError(f"blocksize must be a positive integer, got {blocksize!r}")


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor | None = None, blocksize: int = 256
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (uint8 codes of x's shape, fp32 absmax per block of `blocksize` values).

    Nearest-code rounding: each normalised value goes to the code whose midpoint interval holds it.
    The last block may be short. Blocks of zeros keep absmax 0 and dequantize to 0.
    """
    _check(blocksize)
    code = dynamic_map(signed=True) if code is None else code
    code = code.to(x.device, torch.float32)
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)  # (nblocks, blocksize)
    absmax = blocks.abs().amax(dim=1)  # (nblocks,) fp32
    normed = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    mids = (code[1:] + code[:-1]) / 2  # 255 decision boundaries
    idx = torch.bucketize(normed, mids)  # ties go to the lower code
    codes = idx.to(torch.uint8).view(-1)[:n]
    if pad:
        codes = codes.clone()  # a storage of exactly n bytes, not the padded blocks' (a view would keep them)
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor | None = None,
                         blocksize: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (uint8, any shape) and absmax per block -> values code[codes] * absmax, in `dtype`."""
    _check(blocksize)
    code = dynamic_map(signed=True) if code is None else code
    flat = code.to(codes.device, torch.float32)[codes.reshape(-1).long()]
    n = flat.numel()
    scale = absmax.float().repeat_interleave(blocksize)[:n]
    return (flat * scale).view(codes.shape).to(dtype)
