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


def galore_matrix_state(m: int, n: int, r: int, d: int, eight_bit: bool, proj_dtype: str | None = None) -> int:
    """GaLore's state of one (m, n) matrix at rank r: labkit.optim.galore.state_bytes_for, or
    labkit.optim.galore8bit.state_bytes_for with 8-bit moments (and the projector in proj_dtype)."""
    if eight_bit:
        return galore8bit.state_bytes_for((m, n), r, d, proj_dtype=proj_dtype or "param")
    return galore.state_bytes_for((m, n), r, d)


def state_bytes(spec, d: int, optimizer: str, rank: int | None = None, proj_dtype: str | None = None) -> int:
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
        eight = optimizer == "galore8bit"
        return (sum(galore_matrix_state(*s, rank, d, eight, proj_dtype) for s in spec.galore_shapes)
                + sum((galore8bit if eight else galore).state_bytes_for(s, None, d) for s in _rest_shapes(spec)))
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


# ---- GaLore's step: what labkit.optim.GaLoreAdamW / GaLoreAdamW8bit allocate, op by op -------------------
def galore_steady_bytes(m: int, n: int, r: int, d: int, eight_bit: bool, proj_dtype: str | None = None) -> int:
    """Temporaries of one (m, n) GaLore matrix's step without a refresh, R = r x max(m, n) values:

        GaLoreAdamW:     2 d R      R = P^T G, freed once the moments have it; then sqrt(v) and m / sqrt(v)
        GaLoreAdamW8bit: P' + 16 R  R in fp32; dequantized m and v; sqrt(v) (or the int32 code indices while
                                    m and v are quantized back) and N, all fp32 (8 R: sqrt(v) + eps and N when
                                    R < min_8bit_size keeps m and v fp32); P' = d r k, the projector in the
                                    parameters' dtype, when it is stored in another (fp32 under 16-bit
                                    weights, or int8), alive from the projection to the back-projection.
    """
    R, k = r * max(m, n), r * min(m, n)
    if not eight_bit:
        return 2 * d * R
    pdt = proj_dtype or "param"
    cast = d * k if pdt == "int8" or (pdt == "fp32" and d != 4) else 0
    return cast + (16 if R >= MIN_8BIT else 8) * R


def galore_refresh_split(m: int, n: int, r: int, d: int, eight_bit: bool, proj_dtype: str | None = None
                         ) -> tuple[int, int]:
    """(TEMP, change of OPT) at the worst moment of one (m, n) GaLore matrix's projector refresh, k = min(m, n).
    The old projector is popped before the SVD (OPT - old); the worst moment is the larger of:

        the SVD returns:       TEMP 4 (m k + k + k n)  torch.linalg.svd's U, S, Vh (fp32, full_matrices=False)
                                    + 4 m n            a 16-bit G's fp32 copy, which the SVD reads
                               OPT  - old
        the new projector:     TEMP 4 (m k + k + k n)  (+ 4 r k: an int8 projector's fp32 quotient P / scale)
                               OPT  - old + new = 0    copied out of U or Vh (or quantized) while they live
    """
    k = min(m, n)
    old = galore8bit.projector_bytes((m, n), r, d, proj_dtype or "param") if eight_bit else d * r * k
    usv = 4 * (m * k + k + k * n)
    at_svd = (usv + (4 * m * n if d != 4 else 0), -old)
    at_new = (usv + (4 * r * k if eight_bit and proj_dtype == "int8" else 0), 0)
    return at_new if sum(at_new) >= sum(at_svd) else at_svd


def galore_refresh_bytes(m: int, n: int, r: int, d: int, eight_bit: bool, proj_dtype: str | None = None) -> int:
    """Bytes one (m, n) GaLore matrix's projector refresh adds at its worst moment (`galore_refresh_split`'s sum)."""
    return sum(galore_refresh_split(m, n, r, d, eight_bit, proj_dtype))


def rest_step_bytes(n: int, d: int, optimizer: str) -> int:
    """Temporaries of the step of a parameter of n values that GaLore leaves to Adam: 2 d n for AdamW (sqrt(v)
    and the quotient); 8-bit: 16 n (the fp32 m, v, N and sqrt(v) or the int32 indices, as for R) at or over
    min_8bit_size values, else 8 n (sqrt(v) + eps and N; a 16-bit gradient's fp32 copy, 4 n, is freed first)."""
    if optimizer == "galore":
        return 2 * d * n
    return 16 * n if n >= MIN_8BIT else 8 * n


def galore_step_split(spec, d: int, optimizer: str, rank: int, refresh: bool, proj_dtype: str | None = None
                      ) -> tuple[int, int]:
    """(TEMP, change of OPT) at the worst moment of a GaLore step: the steady step's (the largest matrix's or plain
    parameter's temporaries, OPT unchanged), or with `refresh` the larger of those and the refresh of the matrix
    that costs most (every matrix refreshes; `galore_refresh_split`)."""
    eight = optimizer == "galore8bit"
    steady = max([galore_steady_bytes(m, n, rank, d, eight, proj_dtype) for m, n in spec.galore_shapes]
                 + [rest_step_bytes(math.prod(s), d, optimizer) for s in _rest_shapes(spec)], default=0)
    best = (steady, 0)
    for m, n in spec.galore_shapes if refresh else []:
        split = galore_refresh_split(m, n, rank, d, eight, proj_dtype)
        if sum(split) > sum(best):
            best = split
    return best


def temp_bytes(spec, d: int, optimizer: str, foreach: bool, rank: int | None = None, refresh: bool = False,
               proj_dtype: str | None = None) -> int:
    """The largest temporaries one optimizer step allocates (the ledger's TEMP in the optimizer phase).
    refresh: GaLore's projector-refresh step (an SVD per matrix); other optimizers ignore it."""
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
    if optimizer in ("galore", "galore8bit"):  # with refresh, the OPT change is galore_step_split's second part
        return galore_step_split(spec, d, optimizer, rank, refresh, proj_dtype)[0]
    raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def step_in_backward_units(spec, d: int, optimizer: str, foreach: bool, rank: int | None = None,
                           proj_dtype: str | None = None) -> dict:
    """Step-in-backward: {"block_step": (largest gradient, step temporaries) of one block's parameters,
    "rest_step": the same for the parameters outside the blocks}, and for GaLore "block_refresh" and
    "rest_refresh": the same in a projector-refresh step. Each parameter has an optimizer of its own, so a
    step's temporaries are those of one tensor (foreach included), made while it steps; a refresh's third item
    is the change of OPT then (the old projector freed)."""
    layer = re.compile(r"\.(\d+)\.")
    per_layer = len(spec.galore_shapes) // max(spec.n_layer, 1)
    out = {}
    galore_opt = optimizer in ("galore", "galore8bit")
    for key, block in (("block", True), ("rest", False)):
        found = [layer.search(n) for n in spec.param_names]
        shapes = [s for s, m in zip(spec.param_shapes, found) if (m is not None and m.group(1) == "0" if block else m is None)]
        if not shapes:
            out[f"{key}_step"] = (0, 0)
            if galore_opt:
                out[f"{key}_refresh"] = (0, 0)
            continue
        unit = replace(spec, param_shapes=shapes, param_numels=[math.prod(s) for s in shapes],
                       galore_shapes=spec.galore_shapes[:per_layer] if block else [])
        unit = replace(unit, n_params=unit.largest_param)  # foreach: one tensor per optimizer
        out[f"{key}_step"] = (unit.largest_param * d, temp_bytes(unit, d, optimizer, foreach, rank, False, proj_dtype))
        if galore_opt:  # (gradient, TEMP, change of OPT: the refreshed matrix's old projector freed)
            out[f"{key}_refresh"] = (unit.largest_param * d,
                                     *galore_step_split(unit, d, optimizer, rank, True, proj_dtype))
    return out


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
            "galore8bit": f"projector r k ({d} B, 4 B, or 1 B + 4 B per vector) + 8-bit moments per matrix"}.get(
        optimizer, f"{TORCH_STATES.get(optimizer, 0)} x N x {d} B (+ step counters)")
