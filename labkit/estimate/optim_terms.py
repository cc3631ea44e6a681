"""Optimizer state and step temporaries, per optimizer, from the parameters' shapes.

The state of one tensor is the optimizer module's own rule (labkit.optim.adam8bit, galore, galore8bit,
lion, adafactor: each `state_bytes_for`), summed here over the model's shapes; torch.optim's SGD and
Adam keep d-byte states per element. Checked against the ledger in tests/unit/test_estimate_optim.py.
n is a tensor's element count, d the bytes of the parameters' dtype, (m, n) a matrix's shape with
k = min(m, n), K = max(m, n), r the rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from labkit.optim import adafactor, adam8bit, galore, galore8bit, lion

TORCH_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}  # d-byte states per element
from .recipe import OPTIMIZERS  # noqa: E402  (the names, checked by Recipe)

assert set(TORCH_STATES) <= set(OPTIMIZERS)
# labkit.optim.AdamW8bit's small-tensor limit, block and chunk (its module owns them)
MIN_8BIT, BLOCK, CHUNK = adam8bit.MIN_8BIT_SIZE, adam8bit.BLOCKSIZE, adam8bit.CHUNK_SIZE


def adam8bit_state(n: int) -> int:
    """8-bit Adam's state of a tensor of n values: labkit.optim.adam8bit.state_bytes_for."""
    return adam8bit.state_bytes_for((n,))


def galore_matrix_state(m: int, n: int, r: int, d: int, eight_bit: bool) -> int:
    """GaLore's state of one (m, n) matrix at rank r: labkit.optim.galore.state_bytes_for, or
    labkit.optim.galore8bit.state_bytes_for with 8-bit moments."""
    return (galore8bit if eight_bit else galore).state_bytes_for((m, n), r, d)


def state_bytes(spec, d: int, optimizer: str, rank: int | None = None) -> int:
    """Optimizer state in bytes for every parameter of `spec` (d: bytes per parameter element)."""
    shapes = spec.param_shapes
    if optimizer in TORCH_STATES:
        counters = 4 * len(shapes) if optimizer in ("adam", "adamw") else 0  # a float32 step per tensor
        return TORCH_STATES[optimizer] * spec.n_params * d + counters
    if optimizer in ("adamw8bit", "adam8bit"):
        return sum(adam8bit.state_bytes_for(s) for s in shapes)
    if optimizer == "lion":  # one momentum, in the parameters' dtype
        return sum(lion.state_bytes_for(s, d) for s in shapes)
    if optimizer == "adafactor":  # factored over the last two dims: row and column averages (fp32)
        return sum(adafactor.state_bytes_for(s) for s in shapes)
    if optimizer in ("galore", "galore8bit"):  # the attention/MLP matrices at rank r, the rest plain (8-bit) AdamW
        rule = galore8bit if optimizer == "galore8bit" else galore
        return (sum(rule.state_bytes_for(s, rank, d) for s in spec.galore_shapes)
                + sum(rule.state_bytes_for(s, None, d) for s in _rest_shapes(spec)))
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
    return {"adamw8bit": f"2N + 8 per {BLOCK}-block (fp32 below {MIN_8BIT} elements)",
            "adam8bit": f"2N + 8 per {BLOCK}-block",
            "lion": f"N x {d} B (one momentum)", "adafactor": "4(rows + columns) per tensor of 2+ dims, 4n per vector",
            "galore": f"{d} x r(k + 2K) per attention/MLP matrix, Adam elsewhere",
            "galore8bit": f"{d} x r k + 8-bit moments per matrix"}.get(
        optimizer, f"{TORCH_STATES.get(optimizer, 0)} x N x {d} B (+ step counters)")
