"""Optimizer state and step temporaries, per optimizer, from the parameters' shapes.

The state of one tensor is the optimizer module's own rule (labkit.optim.adam8bit, galore, galore8bit,
lion, adafactor: each `state_bytes_for`), summed here over the model's shapes; torch.optim's SGD and
Adam keep d-byte states per element. The step's own memory (temporaries, and the fp32 working copy of a
16-bit parameter, which the ledger counts as a parameter) follows the ops each step runs: `tensor_step_bytes`
for one tensor, `step_bytes` for a whole step. Checked against the ledger in tests/unit/test_estimate_optim.py.
n is a tensor's element count, d the bytes of the parameters' dtype, (m, n) a matrix's shape with
k = min(m, n), K = max(m, n), r the rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from labkit.memory.state import TORCH_STATES  # d-byte states per element
from labkit.optim import adafactor, adam8bit, galore, galore8bit, lion

from .recipe import OPTIMIZERS  # noqa: E402  (the names, checked by Recipe)

assert set(TORCH_STATES) <= set(OPTIMIZERS)
# labkit.optim.AdamW8bit's small-tensor limit, block and chunk (its module owns them)
MIN_8BIT, BLOCK, CHUNK = adam8bit.MIN_8BIT_SIZE, adam8bit.BLOCKSIZE, adam8bit.CHUNK_SIZE


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
    """The step's temporaries at its worst moment (the ledger's TEMP in the optimizer phase): `step_bytes`, or for
    GaLore `galore_step_split` (refresh: a projector-refresh step, an SVD per matrix; its OPT change apart)."""
    if optimizer in ("galore", "galore8bit"):
        return galore_step_split(spec, d, optimizer, rank, refresh, proj_dtype)[0]
    return step_bytes(spec, d, optimizer, foreach)[1]


def cast_bytes(spec, d: int, optimizer: str, foreach: bool, rank: int | None = None) -> int:
    """The step's fp32 working copies of 16-bit parameters at the same moment (p.float(): PARAM in the
    ledger): `step_bytes`. 0 for fp32 parameters and for GaLore (its rule is in temp_bytes)."""
    if optimizer in ("galore", "galore8bit"):
        return 0
    return step_bytes(spec, d, optimizer, foreach)[0]


def tensor_step_bytes(shape, d: int, optimizer: str) -> tuple[int, int]:
    """(PARAM, TEMP) bytes alive at the worst op of one tensor's step, when it steps on its own (its own
    optimizer under step-in-backward, or a loop whose locals die with each tensor: labkit.optim's methods).
    n = prod(shape); up = 4n when the parameter is 16-bit (d = 2), 0 when it is fp32 (d = 4, mixed included:
    x.float() of an fp32 tensor returns x itself). The ledger counts a cast of a parameter (p.float(): the
    fp32 working copy) as PARAM, any other new storage as TEMP.

    sgd, sgd-momentum: 0, 0. torch.optim._single_tensor_sgd: p.add_(grad or buf, alpha=-lr),
        buf.mul_(momentum).add_(grad): in place.
    adam, adamw: 0, 2dn. torch.optim._single_tensor_adam: denom = (exp_avg_sq.sqrt() / sqrt(1 - b2^t))
        .add_(eps): sqrt(v) (dn) and its quotient (dn) alive together; lerp_, mul_, addcmul_, addcdiv_
        and AdamW's p.mul_(1 - lr wd) work in place.
    lion: 0, dn. labkit.optim.Lion: u = m.mul(b1).add_(g).sign_() in the parameter's dtype.
    adamw8bit, adam8bit, n >= 4096 (labkit.optim.Adam8bit._update_8bit, one chunk of c = min(n, 2^20)
        values at a time): up_c, 16c + up_c, with up_c = 4c for 16-bit: at bucketize (the quantizer's int32
        code indices, 4c) of v.clone() (4c), beside the dequantized fp32 m and v (4c each), g = grad.float()
        (4c TEMP) and p32 = p.float() (4c PARAM).
    adamw8bit, adam8bit, n < 4096 (_update_fp32, fp32 m and v as state): up, 8n + up: m / v.sqrt().add_():
        sqrt(v) (4n) and the quotient (4n), beside g = grad.float() and p32 = p.float().
    adafactor (labkit.optim.Adafactor._update): up, 4n + max(4(rows + columns) + 4, 12) + up, beside
        g = grad.float() (TEMP) and p32 = p.float() (PARAM) and the 0-dim step size lr (4): for 2+ dims the
        update u = r * rsqrt(C) (4n) is made from r = rsqrt(R / mean(R)) (4 x rows) and rsqrt(C)
        (4 x columns); for a vector u = v.rsqrt() (4n), and its clipping, u / (rms(u) / clip_threshold),
        holds two more 0-dim tensors (u.norm(2) / sqrt(n), then / clip_threshold). sq = g.square() (4n)
        is freed before u is made.
    """
    n = math.prod(shape)
    up = 4 * n if d != 4 else 0  # fp32 copy of a 16-bit parameter (PARAM) or gradient (TEMP)
    if optimizer in ("sgd", "sgd-momentum"):
        return 0, 0
    if optimizer in ("adam", "adamw"):
        return 0, 2 * d * n
    if optimizer == "lion":
        return 0, d * n
    if optimizer in ("adamw8bit", "adam8bit"):
        if n < MIN_8BIT:
            return up, 8 * n + up
        c = min(n, CHUNK)
        up_c = 4 * c if d != 4 else 0
        return up_c, 16 * c + up_c
    if optimizer == "adafactor":
        factors = adafactor.state_bytes_for(shape) if len(shape) >= 2 else 0  # 4(rows + columns)
        return up, 4 * n + max(factors + 4, 12) + up
    raise ValueError(f"no per-tensor step rule for optimizer {optimizer!r}")


def step_bytes(spec, d: int, optimizer: str, foreach: bool) -> tuple[int, int]:
    """(PARAM, TEMP) at the worst moment of one optimizer step over all of `spec`'s parameters (one group,
    in the model's parameter order), for every optimizer but GaLore:

    adam, adamw, foreach (torch.optim._multi_tensor_adam): 0, dN: exp_avg_sq_sqrt = _foreach_sqrt(v) for
        every tensor at once, then divided, shifted and used in place.
    adam, adamw, single tensor: 0, max over i of d(2 n_i + n_(i-1)): the loop's `denom` of tensor i-1
        lives until tensor i's quotient replaces it, so it sits beside tensor i's sqrt(v) and quotient.
    the rest: the tensor whose `tensor_step_bytes` total is largest (each tensor steps inside a method
        call of labkit.optim, or in place for SGD).
    """
    if optimizer not in OPTIMIZERS or optimizer.startswith("galore"):
        known = ", ".join(o for o in OPTIMIZERS if not o.startswith("galore"))
        raise ValueError(f"unknown optimizer {optimizer!r} for step_bytes; choose one of {known} (GaLore: temp_bytes)")
    numels = [math.prod(s) for s in spec.param_shapes]
    if optimizer in ("adam", "adamw"):
        if foreach:
            return 0, d * sum(numels)
        return 0, max((d * (2 * n + prev) for prev, n in zip([0, *numels], numels)), default=0)
    return max((tensor_step_bytes(s, d, optimizer) for s in spec.param_shapes), key=sum, default=(0, 0))


def step_in_backward_units(spec, d: int, optimizer: str, foreach: bool, rank: int | None = None,
                           proj_dtype: str | None = None) -> dict:
    """Step-in-backward: {"block_step": (largest gradient, step temporaries, parameter casts) of one block's
    parameters, "rest_step": the same for the parameters outside the blocks but a tied embedding,
    "tied_step": the same for the tied embedding (zeros when the head is untied)}, and for GaLore
    "block_refresh", "rest_refresh", "tied_refresh": the same in a projector-refresh step, with a fourth item,
    the change of OPT then (the refreshed matrix's old projector freed). Each parameter has an optimizer of
    its own, so a step's temporaries are those of one tensor (foreach included: dn for Adam), made while it
    steps: the worst tensor's `tensor_step_bytes`. The tied matrix is apart because it steps last, once the
    embedding's gradient is added to the head's; the others outside the blocks (a position embedding) step
    while the head's part is still held."""
    layer = re.compile(r"\.(\d+)\.")
    per_layer = len(spec.galore_shapes) // max(spec.n_layer, 1)
    found = [layer.search(n) for n in spec.param_names]
    block = [s for s, m in zip(spec.param_shapes, found) if m is not None and m.group(1) == "0"]
    rest = [tuple(s) for s, m in zip(spec.param_shapes, found) if m is None]
    tied = []
    if spec.tied and (spec.vocab, spec.hidden) in rest:  # the embedding the head shares (parameters() gives it once)
        rest.remove((spec.vocab, spec.hidden))
        tied = [(spec.vocab, spec.hidden)]
    galore_opt = optimizer in ("galore", "galore8bit")
    out = {}
    for key, unit_shapes, galore_shapes in (("block", block, spec.galore_shapes[:per_layer]), ("rest", rest, []),
                                            ("tied", tied, [])):
        if not unit_shapes:
            out[f"{key}_step"] = (0, 0, 0)
            if galore_opt:
                out[f"{key}_refresh"] = (0, 0, 0, 0)
            continue
        grad = max(math.prod(s) for s in unit_shapes) * d
        if galore_opt:
            unit = replace(spec, param_shapes=unit_shapes, param_numels=[math.prod(s) for s in unit_shapes],
                           galore_shapes=galore_shapes)
            unit = replace(unit, n_params=unit.largest_param)  # foreach: one tensor per optimizer
            out[f"{key}_step"] = (grad, temp_bytes(unit, d, optimizer, foreach, rank, False, proj_dtype), 0)
            temp, opt_change = galore_step_split(unit, d, optimizer, rank, True, proj_dtype)
            out[f"{key}_refresh"] = (grad, temp, 0, opt_change)
            continue
        one = [(0, d * math.prod(s)) if optimizer in ("adam", "adamw") and foreach  # _foreach_sqrt of one tensor
               else tensor_step_bytes(s, d, optimizer) for s in unit_shapes]
        cast, temp = max(one, key=sum)
        out[f"{key}_step"] = (grad, temp, cast)
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
