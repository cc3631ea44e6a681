"""Reference solution for lesson 00's warm-up exercise (tests/unit/test_exercises.py checks it)."""

import torch


BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 1}  # one number, in each dtype the warm-up may ask


def weight_bytes(model: torch.nn.Module, dtype: str = "fp32") -> int:
    """The weights stored in `dtype` (EX0.dtype; fp32 in the lesson): bytes per number x parameters;
    parameters() yields a tied (shared) matrix once."""
    return sum(p.numel() for p in model.parameters()) * BYTES[dtype]


def gpt_params(cfg) -> int:
    """Token and position tables (V d + P d; the head is tied to the token table), then per block two LayerNorms
    (2 d each with biases, d without) and four Linear layers, d -> 3d, d -> d, d -> 4d, 4d -> d (12 d^2 weights,
    9 d biases), and the final LayerNorm."""
    d, b = cfg.n_embd, cfg.bias
    norm = 2 * d if b else d
    block = 2 * norm + 12 * d * d + (9 * d if b else 0)
    return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + norm


WHY_PEAK = "b"
