"""8-bit GaLore: GaLore's low-rank Adam moments stored as 1-byte dynamic-map codes, stepped without copying the weight.

The projected moments (r x max(m, n)) are quantized blockwise as bitsandbytes' 8-bit Adam does
(Dettmers et al. 2022, arXiv 2110.02861; bitsandbytes 0.50, blocks of 256 since bitsandbytes PR #1365;
GaLore: Zhao et al. 2024, arXiv 2403.03507): m with the signed dynamic map, v with the unsigned one, one fp32
absmax per 256 values; states under `min_8bit_size` (4096) values stay fp32. The update follows
bitsandbytes' arithmetic, lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps), then is projected back.

galore-torch's GaLoreAdamW8bit gets the same result by swapping `p.data` for a zero low-rank tensor so
bitsandbytes can step it, after cloning the whole weight (`p.saved_data = p.data.clone()`): m*n extra
values each step, and the parameter's storage is replaced by the clone. Here the low-rank update is
computed directly and added into the weight in place: no copy of the weight, and its storage stays.

A reference bug (galore-torch 1.0 with bitsandbytes 0.50): galore-torch passes `percentile_clipping=100,
block_wise=True` to bitsandbytes' update by position, and 0.50 removed those two arguments, so they land
in `max_unorm=100, skip_zeros=True`. For projected states under 4096 values (kept fp32) the 32-bit
kernel then clips each update's norm to 100 x the norm of the parameter it steps, which galore-torch
has swapped for an all-zero low-rank stand-in: those matrices never update. Parity is therefore
checked on states of at least 4096 values (lesson 06 shows the bug).
"""

from __future__ import annotations

import math

import torch

from labkit.quant.dynamic import code_map

from . import adam8bit
from .adam8bit import BLOCKSIZE, MIN_8BIT_SIZE  # the 8-bit rule's block and small-state limit: one owner
from .base import KeepStateDtypes, StepsEachParameter, check_betas, check_int, check_number
from .galore import add_back_projected, check_galore_adam_group, make_projector, project, projection_side

# The projector's precision: "param" keeps it in the parameters' dtype, as galore-torch does (its
# GaLoreProjector casts the SVD's fp32 vectors back to the gradient's dtype: BF16 in the paper's runs);
# "fp32" keeps the SVD's own precision; "int8" stores one int8 code per value and one fp32 absmax scale
# per singular vector (r scales), dequantized to the parameters' dtype for each step's two products.
PROJ_DTYPES = ("param", "fp32", "int8")


def check_proj_dtype(proj_dtype) -> str:
    if proj_dtype not in PROJ_DTYPES:
        raise ValueError(f"proj_dtype must be one of {', '.join(PROJ_DTYPES)}, got {proj_dtype!r}")
    return proj_dtype


def projector_bytes(shape, rank: int, dtype_bytes: int = 4, proj_dtype: str = "param") -> int:
    """Bytes of one (m, n) matrix's projector (rank x min(m, n) values): dtype_bytes each ("param"), 4 each
    ("fp32"), or 1 each + 4 per singular vector ("int8": codes and the r absmax scales)."""
    k = rank * min(shape)
    return {"param": dtype_bytes * k, "fp32": 4 * k, "int8": k + 4 * rank}[check_proj_dtype(proj_dtype)]


def state_bytes_for(shape, rank: int | None, dtype_bytes: int = 4, blocksize: int = BLOCKSIZE,
                    min_8bit_size: int = MIN_8BIT_SIZE, proj_dtype: str = "param") -> int:
    """State bytes of one tensor under 8-bit GaLore: for an (m, n) GaLore matrix the projector
    (`projector_bytes`: dtype_bytes * rank * min(m, n) in the parameters' dtype, the default), plus Adam's
    m and v of the projected gradient (rank * max(m, n) values) under the 8-bit rule; without a rank (a
    parameter left to plain 8-bit AdamW) the 8-bit rule on all its values. The 8-bit rule is
    labkit.optim.adam8bit.state_bytes_for: 2k + 8*ceil(k/blocksize) for k values, 8k below min_8bit_size.
    Source: Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection"
    (GaLoreAdamW8bit); Dettmers et al. 2022 for the 8-bit moments."""
    if rank is None:
        proj, k = 0, math.prod(shape)
    else:
        proj, k = projector_bytes(shape, rank, dtype_bytes, proj_dtype), rank * max(shape)
    return proj + adam8bit.state_bytes_for((k,), blocksize, min_8bit_size)


class GaLoreAdamW8bit(StepsEachParameter, KeepStateDtypes, torch.optim.Optimizer):
    """GaLore with 8-bit moments (parity with galore-torch's GaLoreAdamW8bit on bitsandbytes >= 0.50).

    Groups with "rank" (and update_proj_gap, scale, proj_type, as for GaLoreAdamW) are projected; the
    others get plain 8-bit AdamW. Weight decay follows the reference: for projected matrices after
    the update (p += -lr*wd*p), for the others before it (p *= 1 - lr*wd), as bitsandbytes does.

    proj_dtype: the projector's precision (PROJ_DTYPES): "param" (default, as galore-torch: the
    parameters' dtype), "fp32", or "int8" (a code per value and an fp32 scale per singular vector).

    State per parameter: "step" (Python int), for GaLore matrices "projector" (or int8
    "projector_codes", one singular vector per row, and fp32 "projector_scale"), and either uint8
    "exp_avg_codes", "exp_avg_sq_codes" (R's shape) with fp32 "exp_avg_absmax", "exp_avg_sq_absmax"
    (one per block), or fp32 "exp_avg", "exp_avg_sq" for states under min_8bit_size values.
    Step temporaries per GaLore matrix: the projector in the parameters' dtype when it is stored in
    another (r*k values), and at most 16 bytes per value of R (R; then dequantized m and v, N, and
    sqrt(v) or the int32 code indices), never an (m, n) tensor; every update_proj_gap steps the SVD adds
    U, S, Vh (k*(m + n + 1) fp32, k = min(m, n)).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, blocksize: int = BLOCKSIZE, min_8bit_size: int = MIN_8BIT_SIZE,
                 proj_dtype: str = "param"):
        defaults = dict(lr=check_number("lr", lr), betas=check_betas(betas), eps=check_number("eps", eps),
                        weight_decay=check_number("weight_decay", weight_decay),
                        blocksize=check_int("blocksize", blocksize),
                        min_8bit_size=check_int("min_8bit_size", min_8bit_size, low=0),
                        proj_dtype=check_proj_dtype(proj_dtype))
        super().__init__(params, defaults)
        for p in {p.device: p for g in self.param_groups for p in g["params"]}.values():
            code_map(True, p.device), code_map(False, p.device)  # made now, not inside a measured step

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        check_galore_adam_group(self.param_groups[-1])
        check_proj_dtype(self.param_groups[-1]["proj_dtype"])

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        if not state:
            state["step"] = 0
        side = None
        if "rank" in group:
            side = projection_side(p.shape, group["proj_type"])
            if state["step"] % group["update_proj_gap"] == 0:
                self._refresh_projector(state, p.grad, group["rank"], side, group["proj_dtype"])
            P = self._projector(state, p.grad.dtype, side)  # in the gradient's dtype (a copy unless stored so)
            grad = project(p.grad, P, side).float()  # (r, n) or (m, r)
        else:
            grad = p.grad.float()
        if "exp_avg" not in state and "exp_avg_codes" not in state:
            self._init_moments(state, grad, group)
        m, v = self._moments(state, group)  # fp32, R's shape (fresh copies when 8-bit)
        (b1, b2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        state["step"] += 1
        t = state["step"]
        m.mul_(b1).add_(grad, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        del grad
        c1, c2 = 1.0 - b1**t, math.sqrt(1.0 - b2**t)
        if "exp_avg" in state:  # fp32 state, in bitsandbytes' 32-bit kernel's order
            update, step_size = m / (v.sqrt() + eps * c2), -lr * c2 / c1
        else:
            update, step_size = m / v.sqrt().div_(c2).add_(eps), -lr / c1
            for name, x, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):  # overwrites m, then v
                adam8bit.quantize_state(x, state[f"{name}_codes"], state[f"{name}_absmax"], signed, group["blocksize"])
        del m, v
        update = update.to(p.dtype)
        if side is None:
            if wd > 0.0:
                p.mul_(1.0 - lr * wd)
            p.add_(update, alpha=step_size)
            return
        add_back_projected(p, update, P, side, step_size * group["scale"])  # no (m, n) temporary
        del update, P
        if wd > 0.0:
            p.add_(p, alpha=-lr * wd)

    @staticmethod
    def _refresh_projector(state: dict, grad: torch.Tensor, rank: int, side: str, proj_dtype: str) -> None:
        """A new projector from grad's SVD, in `proj_dtype`; the old one is freed before the SVD runs."""
        for key in ("projector", "projector_codes", "projector_scale"):
            state.pop(key, None)
        if proj_dtype != "int8":
            state["projector"] = make_projector(grad, rank, side, torch.float32 if proj_dtype == "fp32" else None)
            return
        U, S, Vh = torch.linalg.svd(grad.float(), full_matrices=False)  # bytes: 4*(m*k + k + k*n), k=min(m,n)
        P = U[:, :rank].t() if side == "left" else Vh[:rank]  # (r, k) view: one singular vector per row
        scale = P.abs().amax(dim=1).div_(127)  # absmax per vector (bytes: 4 per value while abs lives)
        state["projector_scale"] = scale
        # bytes: the fp32 quotient (4 per value) and the codes (1 per value); |P| <= 1, so no scale is 0
        # unless a whole vector is (then its codes are 0 too)
        state["projector_codes"] = P.div(scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round_().to(
            torch.int8)

    @staticmethod
    def _projector(state: dict, dtype: torch.dtype, side: str) -> torch.Tensor:
        """The projector in `dtype`, (m, r) on the left and (r, n) on the right: the stored tensor when it is
        in `dtype` already, else a cast (fp32 projector, 16-bit weights) or a dequantized copy (int8)."""
        if "projector" in state:
            return state["projector"].to(dtype)
        codes, scale = state["projector_codes"], state["projector_scale"]
        P = codes.to(dtype).mul_(scale.to(dtype)[:, None])  # (r, k); bytes: r*k in dtype (+ r for the scales)
        return P.t() if side == "left" else P

    def _init_moments(self, state: dict, low: torch.Tensor, group: dict) -> None:
        if low.numel() < group["min_8bit_size"]:
            state["exp_avg"] = torch.zeros_like(low, dtype=torch.float32)  # bytes: 4 per value
            state["exp_avg_sq"] = torch.zeros_like(low, dtype=torch.float32)
            return
        blocks = math.ceil(low.numel() / group["blocksize"])
        for name in ("exp_avg", "exp_avg_sq"):
            state[f"{name}_codes"] = torch.zeros(low.shape, dtype=torch.uint8, device=low.device)  # 1 per value
            state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=low.device)  # 4 per block

    def _moments(self, state: dict, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "exp_avg" in state:
            return state["exp_avg"], state["exp_avg_sq"]
        bs = group["blocksize"]
        return tuple(adam8bit.dequantize_state(state[f"{name}_codes"], state[f"{name}_absmax"], signed, bs)
                     for name, signed in (("exp_avg", True), ("exp_avg_sq", False)))
