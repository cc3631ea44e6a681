"""Adafactor: Adam-like steps whose second moment of an m x n matrix is stored as m row + n column averages.

Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", with the
defaults and arithmetic of `transformers.optimization.Adafactor`. For a gradient G (m, n) at step t:

    b2_t = 1 - t^decay_rate                                        # decay_rate -0.8: b2_1 = 0
    R = b2_t*R + (1-b2_t) * mean_cols(G^2 + eps1)                  # (m,)
    C = b2_t*C + (1-b2_t) * mean_rows(G^2 + eps1)                  # (n,)
    V ~ outer(R, C) / mean(R)                                      # the rank-1 fit, never stored
    U = G / sqrt(V);  U /= max(1, rms(U) / clip_threshold)         # update clipping
    lr_t = max(eps2, rms(p)) * min(1e-2, 1/sqrt(t))  (relative_step and scale_parameter)
    [m = b1*m + (1-b1)*lr_t*U;  U = m]   if beta1 is set
    p -= lr_t*wd*p + lr_t*U

Vectors (and scalars) keep the full second moment, as Adam does. With beta1=None the state of an
m x n matrix is 4(m + n) bytes instead of Adam's 8mn.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

from .base import KeepStateDtypes, StepsEachParameter, check_number


def state_bytes_for(shape, beta1: float | None = None) -> int:
    """fp32 state bytes of one parameter tensor: 4 x (m + n) for an (..., m, n) tensor's row and
    column averages (4 x prod(shape[:-1]) + 4 x prod(shape[:-2]) x n), 4 per element for a vector,
    + 4 per element for the first moment when beta1 is set. The step counter is a Python int.
    Source: Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost"
    (section 3, factored second moment); transformers' Adafactor (exp_avg_sq_row, exp_avg_sq_col)."""
    n = math.prod(shape)
    if len(shape) >= 2:
        second = math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    else:
        second = n
    return 4 * second + (4 * n if beta1 is not None else 0)


# ---- the teaching version: what the row and column averages stand for ---------------------------
def factored_second_moment(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """The (m, n) second-moment estimate from row averages R (m,) and column averages C (n,):
    outer(R, C) / mean(R), the rank-1 matrix whose row and column means are R and C (it minimises
    the I-divergence to the full V; Shazeer & Stern 2018, section 3). Exact when V is rank 1."""
    return torch.outer(row, col) / row.mean()


def inverse_sqrt_second_moment(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(factored_second_moment(row, col)) for (..., m) rows and (..., n) columns, without forming
    the estimate first: rsqrt(R / mean(R)) (m, 1) times rsqrt(C) (1, n)."""
    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)  # (..., m, 1)
    return r * col.unsqueeze(-2).rsqrt()  # (..., m, n): bytes: 4 per element of the parameter


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.norm(2) / (x.numel() ** 0.5)


# ---- the real one ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdafactorHP:
    """Adafactor's hyperparameters: transformers' names and defaults, checked (numbers made floats)."""

    lr: float | None = None  # None with relative_step; a number > 0 without
    eps: tuple = (1e-30, 1e-3)  # (eps1 added to G^2, eps2 the smallest parameter scale)
    clip_threshold: float = 1.0  # the largest rms of an update
    decay_rate: float = -0.8  # b2_t = 1 - t^decay_rate, a number <= 0
    beta1: float | None = None  # None: no first moment; else its decay rate in [0, 1)
    weight_decay: float = 0.0  # p -= lr_t * weight_decay * p
    scale_parameter: bool = True  # the step size times max(eps2, rms(p)): relative to the weights
    relative_step: bool = True  # the step size min(1e-2, 1/sqrt(t)) (or 1e-6 t with warmup_init), not lr
    warmup_init: bool = False  # with relative_step: start at 1e-6 t

    def __post_init__(self) -> None:
        if self.lr is not None and self.relative_step:
            raise ValueError("lr must be None when relative_step=True (the step is relative); pass relative_step=False")
        if self.lr is None and not self.relative_step:
            raise ValueError("lr must be a number when relative_step=False")
        if self.warmup_init and not self.relative_step:
            raise ValueError("warmup_init=True needs relative_step=True")
        if not isinstance(self.eps, (tuple, list)) or len(self.eps) != 2:
            raise ValueError(f"eps must be a pair (eps1, eps2) of non-negative numbers, got {self.eps!r}")
        checked = dict(lr=None if self.lr is None else check_number("lr", self.lr, low_open=True),
                       eps=(check_number("eps[0]", self.eps[0]), check_number("eps[1]", self.eps[1])),
                       clip_threshold=check_number("clip_threshold", self.clip_threshold, low_open=True),
                       decay_rate=check_number("decay_rate", self.decay_rate, low=-math.inf, high=0.0,
                                               low_open=True, high_open=False),
                       beta1=None if self.beta1 is None else check_number("beta1", self.beta1, 0.0, 1.0),
                       weight_decay=check_number("weight_decay", self.weight_decay),
                       scale_parameter=bool(self.scale_parameter), relative_step=bool(self.relative_step),
                       warmup_init=bool(self.warmup_init))
        for name, value in checked.items():
            object.__setattr__(self, name, value)


HP_NAMES = tuple(f.name for f in fields(AdafactorHP))


class Adafactor(StepsEachParameter, KeepStateDtypes, torch.optim.Optimizer):
    """Adafactor with transformers' arguments, defaults and results (parity with its `Adafactor`).

    lr: None with relative_step=True (the step size is min(1e-2, 1/sqrt(t)), or 1e-6*t with
        warmup_init); a number with relative_step=False.
    eps: (eps1 added to G^2, eps2 the smallest parameter scale). clip_threshold: the largest rms of
        an update. decay_rate: b2_t = 1 - t^decay_rate. beta1: None (no first moment) or a number.
    scale_parameter: multiply the step size by max(eps2, rms(p)), so it is relative to the weights.
    State per parameter: "step" (a Python int), "exp_avg_sq_row" and "exp_avg_sq_col" (matrices) or
    "exp_avg_sq" (vectors), and "exp_avg" when beta1 is set; fp32 for fp32, fp16 and bf16 parameters.
    """

    def __init__(self, params, lr: float | None = None, **hparams):
        """hparams: transformers' keywords, the fields of AdafactorHP (eps, clip_threshold, decay_rate,
        beta1, weight_decay, scale_parameter, relative_step, warmup_init)."""
        unknown = [k for k in hparams if k not in HP_NAMES]
        if unknown:
            raise TypeError(f"Adafactor got an unexpected keyword argument {unknown[0]!r}; its hyperparameters "
                            f"are {', '.join(HP_NAMES)}")
        super().__init__(params, asdict(AdafactorHP(lr=lr, **hparams)))

    @staticmethod
    def _lr(group: dict, step: int, p_rms: torch.Tensor):
        """The step size: relative (min(1e-2 or 1e-6*t, 1/sqrt(t))) or lr, times max(eps2, rms(p))."""
        lr = group["lr"]
        if group["relative_step"]:
            lr = min(1e-6 * step if group["warmup_init"] else 1e-2, 1.0 / math.sqrt(step))
        scale = 1.0
        if group["scale_parameter"]:
            scale = max(group["eps"][1], p_rms)  # a float or a 0-dim tensor, as transformers does
        return scale * lr

    def _init_state(self, g: torch.Tensor, state: dict, group: dict) -> None:
        state["step"] = 0
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(g)  # bytes: 4 per element
        if g.dim() >= 2:
            state["exp_avg_sq_row"] = g.new_zeros(g.shape[:-1])  # (..., m): bytes 4m
            state["exp_avg_sq_col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])  # (..., n): bytes 4n
        else:
            state["exp_avg_sq"] = torch.zeros_like(g)  # bytes: 4 per element

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        g = p.grad.float() if p.grad.dtype in (torch.float16, torch.bfloat16) else p.grad
        if not state:
            self._init_state(g, state, group)
        p32 = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
        state["step"] += 1
        t = state["step"]
        lr = self._lr(group, t, _rms(p32))
        b2t = 1.0 - math.pow(t, group["decay_rate"])
        sq = g.square().add_(group["eps"][0])  # G^2 + eps1: bytes: 4 per element
        if g.dim() >= 2:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(b2t).add_(sq.mean(dim=-1), alpha=1.0 - b2t)
            col.mul_(b2t).add_(sq.mean(dim=-2), alpha=1.0 - b2t)
            del sq
            u = inverse_sqrt_second_moment(row, col).mul_(g)  # G / sqrt(V)
        else:
            v = state["exp_avg_sq"]
            v.mul_(b2t).add_(sq, alpha=1.0 - b2t)
            del sq
            u = v.rsqrt().mul_(g)
        u.div_((_rms(u) / group["clip_threshold"]).clamp_(min=1.0))  # update clipping
        u.mul_(lr)
        if group["beta1"] is not None:
            m = state["exp_avg"]
            m.mul_(group["beta1"]).add_(u, alpha=1 - group["beta1"])
            u = m
        if group["weight_decay"] != 0:
            p32.add_(p32, alpha=-group["weight_decay"] * lr)
        p32.sub_(u)
        if p32 is not p:
            p.copy_(p32)
