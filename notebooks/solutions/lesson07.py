"""Reference solutions for lesson 07's exercises (tests/unit/test_exercises_07.py checks each one)."""

import torch


# ---- exercise 1: bits per parameter of NF4 with double quantization -------------------------------------
def nf4_bits(blocksize: int = 128, dq_blocksize: int = 256) -> float:
    """4 bits of code + an 8-bit absmax code per block + an fp32 scale per dq_blocksize blocks."""
    return 4 + 8 / blocksize + 32 / (blocksize * dq_blocksize)


NF4_BITS_128 = nf4_bits(128)  # 4.0635, the lesson's own blocks of 128


# ---- exercise 2: what one outlier does to per-tensor absmax int8 ----------------------------------------
def zeros_per_tensor(w: torch.Tensor, bits: int = 8) -> int:
    """One step = max|w| / (2**(bits-1) - 1) for the whole tensor (max|w| / 127 for int8); round(w / step) == 0
    for every |w| under half a step."""
    step = w.abs().max() / (2 ** (bits - 1) - 1)
    return int((torch.round(w / step) == 0).sum())


# ---- exercise 3: the bytes of an AWQ int4 layer whose scale stays in the layer ---------------------------
def awq_bytes(d_out: int = 384, d_in: int = 1536, group: int = 128) -> int:
    """Packed codes n/2, an fp16 step + a uint8 zero point per group (3 n / group), an fp16 scale per input feature."""
    n = d_out * d_in
    return n // 2 + 3 * n // group + 2 * d_in


AWQ_BYTES_W = awq_bytes()  # 311,808 for MiniLM's (384, 1536) output.dense, groups of 128 (the lesson's own)


# ---- exercise 4: blockwise zero-point int8, as a function -----------------------------------------------------
def zeropoint_blocks(x: torch.Tensor, blocksize: int):
    """Each block of `blocksize` values: its range [min, max], stretched to hold 0, spread over codes 0..255."""
    g = x.float().reshape(-1, blocksize)
    lo, hi = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)
    scale = (hi - lo) / 255
    step = scale.clamp_min(1e-30)[:, None]
    zero = torch.round(-lo[:, None] / step).clamp(0, 255)
    codes = (torch.round(g / step) + zero).clamp(0, 255)
    return codes.to(torch.uint8).view(x.shape), scale, zero.view(-1).to(torch.uint8)


# ---- exercise 5 --------------------------------------------------------------------------------------------
WHY_127 = "c"
