"""The 8-bit dynamic ("tree") map and blockwise absmax quantization, as 8-bit optimizers and NF4's
double quantization use them.

Each block of `blocksize` values is divided by its largest magnitude (absmax), so it lies in
[-1, 1], and every value is replaced by the index of the nearest of 256 code values. The dynamic map
spends its codes like a float: one decade per exponent step, from about 1e-6 up to 1, finer near 1.
Storage: 1 byte per value + 4 bytes (fp32 absmax) per block, e.g. 2.03 bytes/param for Adam's m+v.

One implementation: `quantize_blockwise_` and `dequantize_blockwise_` work on a flat fp32 tensor in
place, block by block (no padded copy, int32 indices), and everything else calls them: the functional
`quantize_blockwise` / `dequantize_blockwise` here, the 8-bit optimizers a chunk at a time
(labkit.optim.adam8bit, galore8bit) and NF4's first level with its own 16 codes (labkit.quant.nf4).
"""

from __future__ import annotations

import math

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
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize <= 0:
        raise ValueError(f"blocksize must be a positive integer, got {blocksize!r}")


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The len(code) - 1 decision boundaries between sorted codes: the nearest code = bucketize on these."""
    return (code[1:] + code[:-1]) / 2


_MAPS: dict = {}  # (signed, device) -> (256 codes, 255 midpoints): 4 KiB per device, not state


def code_map(signed: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic map's 256 codes and the 255 midpoints between them, made once per device and shared by
    every 8-bit optimizer (step-in-backward makes one optimizer per parameter)."""
    key = (signed, torch.device(device))
    if key not in _MAPS:
        code = dynamic_map(signed=signed).to(device)
        _MAPS[key] = code, midpoints(code)  # bytes: 1 KiB + 1020 B
    return _MAPS[key]


def block_rows(x: torch.Tensor, per_block: torch.Tensor, blocksize: int):
    """(rows, per-block values) pairs that cover flat x: the full blocks as a (nblocks, blocksize) view,
    then the short last block as a (1, rest) view; per_block holds one value per block."""
    full = x.numel() // blocksize
    if full:
        yield x[: full * blocksize].view(full, blocksize), per_block[:full]
    if x.numel() > full * blocksize:
        yield x[full * blocksize:].view(1, -1), per_block[full:full + 1]


def quantize_blockwise_(x: torch.Tensor, codes_out: torch.Tensor, absmax_out: torch.Tensor, mids: torch.Tensor,
                        blocksize: int) -> None:
    """Blockwise absmax quantization in place: flat fp32 x is divided by each block's max |x| (written to
    absmax_out, fp32, one per block) and codes_out (flat, x's length) gets the index of the nearest code,
    by bucketize on the codes' midpoints `mids` (a tie goes to the lower code). x is overwritten.
    A block of zeros keeps absmax 0 (its values are divided by the smallest normal float, staying 0).
    bytes: the int32 code indices, 4 per value, beside x (Dettmers et al. 2022, 8-bit Optimizers via
    Block-wise Quantization; bitsandbytes' quantize_blockwise)."""
    for rows, amax in block_rows(x, absmax_out, blocksize):
        amax.copy_(torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()))  # max |x| per block
        rows.div_(amax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))  # in [-1, 1]
    codes_out.copy_(torch.bucketize(x, mids, out_int32=True))


def dequantize_blockwise_(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int
                          ) -> torch.Tensor:
    """uint8 codes (any shape) -> flat fp32 code[codes] * absmax of each value's block, scaled in place.
    bytes: 4 per value (the result) + 4 per value for the int32 index while it is looked up."""
    x = code.index_select(0, codes.reshape(-1).int())
    for rows, scale in block_rows(x, absmax, blocksize):
        rows.mul_(scale.unsqueeze(1))
    return x


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor | None = None, blocksize: int = 256
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (uint8 codes of x's shape, fp32 absmax per block of `blocksize` values).

    Nearest-code rounding: each normalised value goes to the code whose midpoint interval holds it.
    The last block may be short. Blocks of zeros keep absmax 0 and dequantize to 0.
    """
    _check(blocksize)
    code = dynamic_map(signed=True) if code is None else code
    code = code.to(x.device, torch.float32)
    flat = x.detach().reshape(-1).to(torch.float32, copy=True)  # normalised in place below
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(math.ceil(flat.numel() / blocksize), dtype=torch.float32, device=x.device)
    quantize_blockwise_(flat, codes, absmax, midpoints(code), blocksize)
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor | None = None,
                         blocksize: int = 256, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (uint8, any shape) and absmax per block -> values code[codes] * absmax, in `dtype`."""
    _check(blocksize)
    code = dynamic_map(signed=True) if code is None else code
    x = dequantize_blockwise_(codes, absmax.float(), code.to(codes.device, torch.float32), blocksize)
    return x.view(codes.shape).to(dtype)
