"""Optimizer state and step temporaries, per optimizer, from the parameters' shapes.

Each formula is the state labkit.optim (or torch.optim) keeps, counted per tensor and checked
against the ledger in tests/unit/test_estimate_optim.py. n is a tensor's element count, d the bytes
of the parameters' dtype, (m, n) a matrix's shape with k = min(m, n), K = max(m, n), r the rank.
"""

from __future__ import annotations

import math

TORCH_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}  # d-byte states per element
OPTIMIZERS = (*TORCH_STATES, "adamw8bit", "adam8bit", "lion", "adafactor", "galore", "galore8bit")
MIN_8BIT, BLOCK, CHUNK = 4096, 256, 1 << 20  # labkit.optim.AdamW8bit's small-tensor limit, block, chunk


def adam8bit_state(n: int) -> int:
    """8-bit Adam: m and v as uint8 codes + one fp32 absmax per 256-block each: 2n + 8*ceil(n/256);
    tensors under 4096 elements keep fp32 m and v: 8n (bitsandbytes' min_8bit_size)."""
    return 8 * n if n < MIN_8BIT else 2 * n + 8 * math.ceil(n / BLOCK)


def galore_matrix_state(m: int, n: int, r: int, d: int, eight_bit: bool) -> int:
    """GaLore: projector k x r (d bytes) + Adam's m and v in the r x K projected space:
    d*r*(k + 2K), or with 8-bit moments d*r*k + the 8-bit rule for s = r*K values."""
    k, K = min(m, n), max(m, n)
    if eight_bit:
        return d * r * k + adam8bit_state(r * K)
    return d * r * (k + 2 * K)


def state_bytes(spec, d: int, optimizer: str, rank: int | None = None) -> int:
    """Optimizer state in bytes for every parameter of `spec` (d: bytes per parameter element)."""
    shapes = spec.param_shapes
    if optimizer in TORCH_STATES:
        counters = 4 * len(shapes) if optimizer in ("adam", "adamw") else 0  # a float32 step per tensor
        return TORCH_STATES[optimizer] * spec.n_params * d + counters
    if optimizer in ("adamw8bit", "adam8bit"):
        return sum(adam8bit_state(math.prod(s)) for s in shapes)
    if optimizer == "lion":
        return spec.n_params * d  # one momentum, in the parameters' dtype
    if optimizer == "adafactor":  # factored second moment: a row and a column average per matrix (fp32)
        return sum(4 * (s[0] + s[1]) if len(s) == 2 else 4 * math.prod(s) for s in shapes)
    if optimizer in ("galore", "galore8bit"):
        eight = optimizer == "galore8bit"
        chosen = spec.galore_shapes
        rest = spec.n_params - sum(m * n for m, n in chosen)
        rest_state = sum(adam8bit_state(math.prod(s)) for s in _rest_shapes(spec)) if eight else 2 * d * rest
        return sum(galore_matrix_state(m, n, rank, d, eight) for m, n in chosen) + rest_state
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def temp_bytes(spec, d: int, optimizer: str, foreach: bool, rank: int | None = None) -> int:
    """The largest temporaries one optimizer step allocates (the ledger's TEMP in the optimizer phase)."""
    largest = spec.largest_param
    if optimizer in ("adam", "adamw"):  # sqrt(v) and sqrt(v)/c: per tensor, or for all tensors (foreach)
        return (spec.n_params if foreach else 2 * largest) * d
    if optimizer in ("sgd", "sgd-momentum"):
        return 0
    if optimizer in ("adamw8bit", "adam8bit"):  # fp32 m, v, normalised copy and int32 index of a chunk
        big = [math.prod(s) for s in spec.param_shapes if math.prod(s) >= MIN_8BIT]
        small = [math.prod(s) for s in spec.param_shapes if math.prod(s) < MIN_8BIT]
        return max(16 * min(CHUNK, max(big, default=0)), 8 * max(small, default=0))
    if optimizer == "lion":
        return d * largest  # the sign update of one tensor
    if optimizer == "adafactor":  # the update of the largest matrix, plus its row and column means
        return max((4 * s[0] * s[1] + 4 * (s[0] + s[1]) + 4 if len(s) == 2 else 4 * math.prod(s))
                   for s in spec.param_shapes)
    if optimizer in ("galore", "galore8bit"):  # the projector's refresh: an SVD of the largest matrix
        svd = max((4 * (m * min(m, n) + min(m, n) + min(m, n) * n) + 4 * rank * min(m, n)
                   + (4 * m * n if d != 4 else 0)) for m, n in spec.galore_shapes)
        steady = max((8 if optimizer == "galore" else 16) * rank * max(m, n) for m, n in spec.galore_shapes)
        return max(svd, steady, 2 * d * max((math.prod(s) for s in _rest_shapes(spec)), default=0))
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def _rest_shapes(spec) -> list[tuple]:
    """Parameters GaLore leaves to plain Adam: all but the attention and MLP matrices."""
    left = list(spec.galore_shapes)
    out = []
    for s in spec.param_shapes:
        if len(s) == 2 and tuple(s) in left:
            left.remove(tuple(s))
        else:
            out.append(tuple(s))
    return out
