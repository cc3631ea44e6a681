"""Reference solutions for lesson 07's exercises (tests/unit/test_exercises_07.py checks each one)."""

import torch


# ---- exercise 1: bits per parameter of NF4 with double quantization -------------------------------------
def nf4_bits(blocksize: int = 128, dq_blocksize: int = 256) -> float:
    """4 bits of code + an 8-bit absmax code per block + an fp32 scale per dq_blocksize blocks."""
    return 4 + 8 / blocksize + 32 / (blocksize * dq_blocksize)


NF4_BITS_128 = nf4_bits(128)  # 4.0635


# ---- exercise 2: what one outlier does to per-tensor absmax int8 ----------------------------------------
def zeros_per_tensor(w: torch.Tensor) -> int:
    """One step = max|w| / 127 for the whole tensor; round(w / step) == 0 for every |w| under half a step."""
    step = w.abs().max() / 127
    return int((torch.round(w / step) == 0).sum())
