"""Optimizer state and step temporaries, per optimizer, from the parameters' shapes.

Each formula is the state labkit.optim (or torch.optim) keeps, counted per tensor and checked
against the ledger in tests/unit/test_estimate_optim.py. n is a tensor's element count, d the bytes
of the parameters' dtype, (m, n) a matrix's shape with k = min(m, n), K = max(m, n), r the rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from labkit.optim import adafactor

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
    if optimizer == "adafactor":  # factored over the last two dims: row and column averages (fp32)
        return sum(adafactor.state_bytes_for(s) for s in shapes)
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
    if optimizer == "adafactor":  # the update of the largest tensor, plus its row and column means (>= 2 dims)
        return max((4 * math.prod(s) + adafactor.state_bytes_for(s) + 4 if len(s) >= 2 else 4 * math.prod(s))
                   for s in spec.param_shapes)
    if optimizer in ("galore", "galore8bit"):  # the projector's refresh: an SVD of the largest matrix
        svd = max(((4 * (m * min(m, n) + min(m, n) + min(m, n) * n) + 4 * rank * min(m, n)
                    + (4 * m * n if d != 4 else 0)) for m, n in spec.galore_shapes), default=0)
        steady = max(((8 if optimizer == "galore" else 16) * rank * max(m, n) for m, n in spec.galore_shapes), default=0)
        return max(svd, steady, 2 * d * max((math.prod(s) for s in _rest_shapes(spec)), default=0))
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def step_in_backward_units(spec, d: int, optimizer: str, foreach: bool, rank: int | None = None) -> dict:
    """Step-in-backward: {"block_step": (largest gradient, step temporaries) of one block's parameters,
    "rest_step": the same for the parameters outside the blocks}. Each parameter has an optimizer of
    its own, so a step's temporaries are those of one tensor (foreach included), made while it steps."""
    layer = re.compile(r"\.(\d+)\.")
    per_layer = len(spec.galore_shapes) // max(spec.n_layer, 1)
    out = []
    for block in (True, False):
        found = [layer.search(n) for n in spec.param_names]
        shapes = [s for s, m in zip(spec.param_shapes, found) if (m is not None and m.group(1) == "0" if block else m is None)]
        if not shapes:
            out.append((0, 0))
            continue
        unit = replace(spec, param_shapes=shapes, param_numels=[math.prod(s) for s in shapes],
                       galore_shapes=spec.galore_shapes[:per_layer] if block else [])
        unit = replace(unit, n_params=unit.largest_param)  # foreach: one tensor per optimizer
        out.append((unit.largest_param * d, temp_bytes(unit, d, optimizer, foreach, rank)))
    return {"block_step": out[0], "rest_step": out[1]}


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


def state_formula(optimizer: str, d: int) -> str:
    """The state term's formula, as the estimate's table shows it."""
    return {"adamw8bit": "2N + 8 per 256-block (fp32 below 4096 elements)", "adam8bit": "2N + 8 per 256-block",
            "lion": f"N x {d} B (one momentum)", "adafactor": "4(rows + columns) per tensor of 2+ dims, 4n per vector",
            "galore": f"{d} x r(k + 2K) per attention/MLP matrix, Adam elsewhere",
            "galore8bit": f"{d} x r k + 8-bit moments per matrix"}.get(
        optimizer, f"{TORCH_STATES.get(optimizer, 0)} x N x {d} B (+ step counters)")
